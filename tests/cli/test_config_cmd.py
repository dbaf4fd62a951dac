"""`kubetrain config validate|show|presets` through the real entry point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from kubetrain.config import Config, load_config
from tests.conftest import RunMain


def test_validate_a_file(run_main: RunMain, tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  max_steps: 3\n")
    code, out, err = run_main("config", "validate", str(f))
    assert (code, err) == (0, "")
    assert out.strip() == f"ok: {f} is valid"


@pytest.mark.parametrize("preset", ["tiny", "gpt2-124m"])
def test_validate_each_preset(run_main: RunMain, preset: str) -> None:
    code, out, _ = run_main("config", "validate", "--preset", preset)
    assert code == 0
    assert out.strip() == f"ok: preset {preset} is valid"


def test_validate_the_default_names_the_default_preset(run_main: RunMain) -> None:
    code, out, _ = run_main("config", "validate", "--set", "run.name=other")
    assert code == 0
    assert out.strip() == "ok: preset tiny is valid"


def test_validate_a_bad_file_is_one_error_line(run_main: RunMain, tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  max_step: 3\n")
    code, out, err = run_main("config", "validate", str(f))
    assert code == 2
    assert out == ""
    assert err == f"error: {f}: unknown key 'train.max_step'; did you mean 'max_steps'?\n"


def test_show_json_is_the_resolved_config_with_defaults(run_main: RunMain) -> None:
    code, out, _ = run_main("config", "show", "--json", "--set", "train.lr=1e-4")
    assert code == 0
    assert len(out.strip().splitlines()) == 1
    shown = json.loads(out)
    assert shown["train"]["lr"] == 1e-4
    # Keys the preset never mentions are filled in.
    assert shown["train"]["beta2"] == 0.95
    assert shown["dist"]["strategy"] == "ddp"
    assert shown["data"]["sources"][0]["text_field"] == "text"
    assert Config.model_validate(shown) == load_config(overrides=["train.lr=1e-4"])


def test_show_yaml_round_trips(run_main: RunMain, tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("model:\n  n_layer: 2\n")
    code, out, _ = run_main("config", "show", str(f))
    assert code == 0
    shown = yaml.safe_load(out)
    assert shown["model"]["n_layer"] == 2
    assert shown["model"]["n_head"] == 4
    assert Config.model_validate(shown) == load_config(f)


def test_show_a_preset(run_main: RunMain) -> None:
    code, out, _ = run_main("config", "show", "-p", "gpt2-124m", "--json")
    assert code == 0
    assert json.loads(out)["model"]["n_embd"] == 768


def test_presets_are_listed(run_main: RunMain) -> None:
    code, out, _ = run_main("config", "presets")
    assert code == 0
    assert {"tiny", "gpt2-124m"} <= set(out.split())


@pytest.mark.slow
def test_config_show_in_a_real_process(cli) -> None:
    done = cli("config", "show", "--json", "--set", "run.seed=7")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1])["run"]["seed"] == 7


def test_explain_a_key(run_main: RunMain) -> None:
    code, out, err = run_main("config", "explain", "train.lr")
    assert (code, err) == (0, "")
    assert out.splitlines()[0] == "train.lr  float = 0.003"


def test_explain_json_lists_every_key(run_main: RunMain) -> None:
    code, out, _ = run_main("config", "explain", "--json")
    assert code == 0
    docs = json.loads(out.strip().splitlines()[-1])
    seed = next(d for d in docs if d["key"] == "run.seed")
    assert (seed["type"], seed["default"]) == ("int", "1337")
    assert all(d["description"] for d in docs)


def test_explain_an_unknown_key_is_one_error_line(run_main: RunMain) -> None:
    code, out, err = run_main("config", "explain", "train.lrr")
    assert (code, out) == (2, "")
    assert err == "error: unknown key 'train.lrr'; did you mean 'train.lr'?\n"


def test_train_help_points_to_explain(run_main: RunMain) -> None:
    code, out, _ = run_main("train", "--help")
    assert code == 0
    assert "kubetrain config explain" in " ".join(out.split())

"""build_sinks: which sinks a config turns on, in which order."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kubetrain.config import load_config
from kubetrain.errors import EXIT_BAD_INPUT, UserInputError
from kubetrain.track.build import build_sinks


def names(overrides: list[str], tmp_path: Path) -> list[str]:
    cfg = load_config(None, None, [f"run.output_dir={tmp_path}", *overrides])
    fan = build_sinks(cfg, tmp_path, 10)
    try:
        return [s.name for s in fan.sinks]
    finally:
        fan.sinks[0].finish("finished")  # metrics.jsonl is opened when built


def test_default_is_jsonl_and_console(tmp_path: Path) -> None:
    assert names([], tmp_path) == ["metrics.jsonl", "console"]
    assert names(["track.console=false"], tmp_path) == ["metrics.jsonl"]


def test_every_tracker_on_console_last(tmp_path: Path) -> None:
    on = ["track.mlflow.enabled=true", "track.tensorboard.enabled=true", "track.prometheus.enabled=true"]
    # console last: when its line appears, every other sink already holds the record
    assert names(on, tmp_path) == ["metrics.jsonl", "mlflow", "tensorboard", "prometheus", "console"]


def test_wandb_sits_beside_mlflow_and_tensorboard(tmp_path: Path) -> None:
    on = ["track.mlflow.enabled=true", "track.tensorboard.enabled=true", "track.wandb.enabled=true"]
    assert names(on, tmp_path) == ["metrics.jsonl", "mlflow", "tensorboard", "wandb", "console"]


def test_wandb_asked_for_but_not_installed_is_bad_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # None in sys.modules is how Python marks a module that cannot be imported (importlib.util.find_spec says None)
    monkeypatch.setitem(sys.modules, "wandb", None)
    cfg = load_config(None, None, [f"run.output_dir={tmp_path}", "track.wandb.enabled=true"])
    with pytest.raises(UserInputError) as info:
        build_sinks(cfg, tmp_path, 10)
    assert info.value.exit_code == EXIT_BAD_INPUT
    assert str(info.value) == "track.wandb.enabled needs the 'wandb' package: pip install 'kubetrain[wandb]'"

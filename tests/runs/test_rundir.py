"""runs.rundir: starting a run directory records who started it with what, and what changed since."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from kubetrain import runs
from kubetrain.config import load_config


def test_restart_records_config_changes_by_dotted_key(tmp_path: Path) -> None:
    path = tmp_path / "run"
    first = runs.start(path, load_config(None, None, ["train.lr=0.003"]), ["train"], world_size=1)
    assert first["starts"] == 1 and first["config_changes"] == []
    again = load_config(None, None, ["train.lr=0.001", "data.sources.0.weight=2"])
    meta = runs.start(path, again, ["train"], world_size=2)
    # a list of mappings (data.sources) changes by index, not as one whole list
    assert meta["config_changes"] == ["data.sources.0.weight: 1.0 -> 2.0", "train.lr: 0.003 -> 0.001"]
    on_disk = json.loads((path / runs.META_FILE).read_text())
    assert on_disk["starts"] == 2 and on_disk["world_size"] == 2
    assert on_disk["history"][0]["changes"] == meta["config_changes"]


def test_update_meta_keeps_what_start_wrote(tmp_path: Path) -> None:
    path = tmp_path / "run"
    runs.start(path, load_config(None, None, []), [], world_size=1)
    runs.update_meta(path, step=7, status="finished")
    meta = runs.read_meta(path)
    assert (meta["step"], meta["status"], meta["starts"]) == (7, "finished", 1)
    assert "updated_at" in meta


def test_a_tracker_run_id_is_kept_across_starts(tmp_path: Path) -> None:
    """W&B's run id in meta.json: a resume (a new start of the run) continues that run instead of a new one."""
    path, cfg = tmp_path / "run", load_config(None, None, [])
    runs.start(path, cfg, [], world_size=1)
    runs.record_tracker(path, "wandb", {"id": "abc123", "project": "p", "entity": None})
    runs.record_tracker(path, "other", {"id": "x"})
    runs.start(path, cfg, [], world_size=2)
    meta = runs.read_meta(path)
    assert meta["trackers"] == {"wandb": {"id": "abc123", "project": "p", "entity": None}, "other": {"id": "x"}}
    assert (meta["starts"], meta["world_size"]) == (2, 2)


SECRET = "hf_" + "Mn5" * 8  # shaped like a Hugging Face token


def test_config_yaml_and_meta_hide_secrets_but_not_harmless_token_words(tmp_path: Path) -> None:
    path = tmp_path / "run"
    first = load_config(None, None, [f"eval.sample_prompt=say {SECRET}", "data.tokenizer.path=tok/v1"])
    runs.start(path, first, ["train", "--set", "data.tokenizer.path=tok/v1"], world_size=1)
    on_disk = (path / runs.CONFIG_FILE).read_text()
    assert SECRET not in on_disk
    config = yaml.safe_load(on_disk)
    assert config["eval"]["sample_prompt"] == "say ***"
    assert config["data"]["tokenizer"]["path"] == "tok/v1" and config["eval"]["sample_tokens"] == 80

    argv = ["train", "--set", "data.tokenizer.path=tok/v2", "--set", "eval.sample_tokens=9",
            "--set", "hf_token=plain-but-secret", "--set", f"model.revision={SECRET}"]
    again = load_config(None, None, [f"eval.sample_prompt=say {SECRET}", "data.tokenizer.path=tok/v2",
                                     "eval.sample_tokens=9"])
    meta = runs.start(path, again, argv[1:], world_size=1)
    # the secret in the prompt did not change, so it is no change; harmless keys are shown as they are
    assert meta["config_changes"] == ["data.tokenizer.path: 'tok/v1' -> 'tok/v2'", "eval.sample_tokens: 80 -> 9"]
    text = (path / runs.META_FILE).read_text()
    assert SECRET not in text and "plain-but-secret" not in text
    assert json.loads(text)["argv"][1:] == ["--set", "data.tokenizer.path=tok/v2", "--set", "eval.sample_tokens=9",
                                            "--set", "hf_token=***", "--set", "model.revision=***"]


def test_starts_count_launcher_starts_and_worker_restarts_apart(tmp_path: Path) -> None:
    """An elastic restart of the workers (restart > 0) is not a resume: `starts` stays, `worker_restarts` grows."""
    path, cfg = tmp_path / "run", load_config(None, None, [])
    assert runs.start(path, cfg, [], world_size=2)["starts"] == 1
    restarted = runs.start(path, cfg, [], world_size=2, restart=1)
    assert (restarted["starts"], restarted["worker_restarts"]) == (1, 1)
    resumed = runs.start(path, cfg, [], world_size=2)  # a new launcher (a pod restart, a relaunch)
    assert (resumed["starts"], resumed["worker_restarts"]) == (2, 1)

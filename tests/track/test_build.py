"""build_sinks: which sinks a config turns on, in which order."""

from __future__ import annotations

from pathlib import Path

from kubetrain.config import load_config
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

"""runs.rundir: starting a run directory records who started it with what, and what changed since."""

from __future__ import annotations

import json
from pathlib import Path

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

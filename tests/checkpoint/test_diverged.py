"""Checkpoints whose weights gave a loss that was not finite: `--resume auto` passes them by, a path still takes one,
and a new save of the same step takes it off the list."""

from __future__ import annotations

from pathlib import Path

import pytest

from kubetrain import checkpoint
from kubetrain.checkpoint import diverged
from kubetrain.errors import NoCheckpointVerifies
from tests.checkpoint.conftest import save_step


def test_resume_auto_passes_by_the_checkpoints_that_led_to_a_nan_stop(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        save_step(tmp_path, step, keep_last=5)
    diverged.mark(tmp_path, ["step-000002", "step-000003"])
    said: list[str] = []
    found = checkpoint.find_resumable(tmp_path, warn=said.append)
    assert found is not None and found.path.name == "step-000001"
    assert len(said) == 2 and all("its weights gave a loss that was not finite" in line for line in said)
    assert checkpoint.resolve(tmp_path / "step-000003").path.name == "step-000003"  # asked for by its path
    save_step(tmp_path, 2, keep_last=5)  # trained again from step 1: a new step 2
    assert diverged.diverged(tmp_path) == {"step-000003"}
    assert checkpoint.find_resumable(tmp_path, warn=said.append).path.name == "step-000002"  # type: ignore[union-attr]


def test_when_every_checkpoint_led_there_nothing_is_started_over_them(tmp_path: Path) -> None:
    save_step(tmp_path, 1)
    diverged.mark(tmp_path, ["step-000001"])
    with pytest.raises(NoCheckpointVerifies, match=r"start afresh under another run\.name"):
        checkpoint.find_resumable(tmp_path, warn=lambda m: None)
    assert (tmp_path / "step-000001").is_dir()

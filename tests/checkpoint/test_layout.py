"""checkpoint.layout: step folder names, which folders count as complete checkpoints, pointers."""

from __future__ import annotations

from pathlib import Path

import pytest

from kubetrain import checkpoint


def test_complete_checkpoints_are_ordered_by_step_and_skip_temporary_folders(tmp_path: Path) -> None:
    for step in (999_999, 1_000_000, 7):
        (tmp_path / checkpoint.step_name(step)).mkdir()
    checkpoint.tmp_dir(tmp_path, 2_000_000).mkdir()  # a save in progress
    (tmp_path / "step-12").mkdir()  # not a step folder: fewer than six digits
    names = [p.name for p in checkpoint.complete_checkpoints(tmp_path)]
    assert names == ["step-000007", "step-999999", "step-1000000"]
    assert checkpoint.complete_checkpoints(tmp_path / "missing") == []


def test_pointer_is_none_when_missing_or_empty(tmp_path: Path) -> None:
    assert checkpoint.pointer(tmp_path, checkpoint.LATEST) is None
    (tmp_path / checkpoint.LATEST).write_text("\n")
    assert checkpoint.pointer(tmp_path, checkpoint.LATEST) is None
    (tmp_path / checkpoint.LATEST).write_text("step-000003\n")
    assert checkpoint.pointer(tmp_path, checkpoint.LATEST) == "step-000003"


@pytest.mark.parametrize("text", ["../../outside", "/etc", "step-000003/../../x", "..", "step-3", "\xff"])
def test_a_pointer_names_a_step_folder_or_nothing(tmp_path: Path, text: str) -> None:
    (tmp_path / "latest").write_bytes(text.encode("latin-1"))  # copied from a store or a pod: not trusted
    assert checkpoint.pointer(tmp_path, checkpoint.LATEST) is None

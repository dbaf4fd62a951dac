"""kubetrain.files: an atomic write replaces the whole file and leaves no temporary file behind."""

from __future__ import annotations

from pathlib import Path

from kubetrain.files import fsync_dir, write_atomic


def test_write_atomic_replaces_and_leaves_nothing_behind(tmp_path: Path) -> None:
    target = tmp_path / "latest"
    write_atomic(target, "step-000001\n")
    write_atomic(target, "step-000002\n")
    assert target.read_text() == "step-000002\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]
    fsync_dir(tmp_path)  # a directory fsync is best effort and never raises
    fsync_dir(tmp_path / "missing")

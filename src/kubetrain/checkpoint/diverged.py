"""Checkpoints whose weights gave a loss that was not finite: `--resume auto` passes them by.

When the NaN guard stops a run (train.max_nonfinite_steps in a row), the checkpoints from the step before the first
skipped one on hold the weights that led there, finite as they may be (seen: 5e28). Resuming from `latest` would
fail the same way, so the guard lists them in checkpoints/.diverged.json (beside them: a checkpoint folder holds what
its meta.json lists), and `find_resumable` skips them; `--resume PATH` still takes one when asked. A later save of
the same step (a resume that went on from an earlier checkpoint) takes its name off the list.
"""

from __future__ import annotations

import json
from pathlib import Path

from kubetrain.files import write_atomic

DIVERGED = ".diverged.json"


def diverged(root: Path) -> set[str]:
    """The names of the checkpoints in `root` whose weights gave a loss that was not finite."""
    try:
        names = json.loads((root / DIVERGED).read_text()).get("checkpoints", [])
    except (OSError, ValueError, AttributeError):
        return set()
    return {str(n) for n in names} if isinstance(names, list) else set()


def mark(root: Path, names: list[str]) -> None:
    """Add `names` to the list (rank 0 only: one writer)."""
    if names:
        write_atomic(root / DIVERGED, json.dumps({"checkpoints": sorted(diverged(root) | set(names))}) + "\n")


def forget(root: Path, name: str) -> None:
    """A new save of `name` holds weights trained again: it is no longer on the list."""
    left = diverged(root)
    if name not in left:
        return
    left.discard(name)
    if left:
        write_atomic(root / DIVERGED, json.dumps({"checkpoints": sorted(left)}) + "\n")
    else:
        (root / DIVERGED).unlink(missing_ok=True)

"""Read run directories back: status, progress and checkpoints, for `runs list/show`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kubetrain import checkpoint, runs


def _status(meta: dict[str, Any]) -> str:
    status = str(meta.get("status", "unknown"))
    if status == "running" and meta.get("host") == os.uname().nodename and meta.get("pid"):
        try:
            os.kill(int(meta["pid"]), 0)
        except ProcessLookupError:
            return "failed"  # the process that was running it is gone without saying so (killed)
        except PermissionError:
            pass
    return status


def describe_run(path: Path) -> dict[str, Any]:
    """One run's summary; a multi-phase run reports its newest phase."""
    meta = runs.read_meta(path)
    phases = sorted((path / "phases").iterdir(), key=lambda p: runs.read_meta(p).get("started_at", 0)) \
        if (path / "phases").is_dir() else []
    if phases and not meta:
        current = phases[-1]
        meta = runs.read_meta(current)
        root = current / runs.CHECKPOINTS
    else:
        root = path / runs.CHECKPOINTS
    return {
        "name": path.name,
        "path": str(path),
        "status": _status(meta),
        "phase": meta.get("phase"),
        "phases": [p.name for p in phases],
        "step": int(meta.get("step", 0)),
        "tokens": int(meta.get("tokens", 0)),
        "best_val_loss": meta.get("best_val_loss"),
        "final_val_loss": meta.get("final_val_loss"),
        "latest": checkpoint.pointer(root, checkpoint.LATEST),
        "best": checkpoint.pointer(root, checkpoint.BEST),
        "checkpoints": [p.name for p in checkpoint.complete_checkpoints(root)],
        "world_size": meta.get("world_size"),
        "started_at": meta.get("started_at"),
    }


def list_runs(folder: Path) -> list[dict[str, Any]]:
    if not folder.is_dir():
        return []
    found = [p for p in sorted(folder.iterdir()) if p.is_dir() and not p.name.startswith(".")
             and ((p / runs.META_FILE).is_file() or (p / "phases").is_dir())]
    return [describe_run(p) for p in found]

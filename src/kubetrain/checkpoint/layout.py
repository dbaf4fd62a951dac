"""Where a checkpoint's files live, what they are called, and the checksum that proves them.

checkpoints/
  step-000200/       model.safetensors  trainer.safetensors  trainer.pt  meta.json       (one process, DDP)
  step-000400/       shards/ (model and optimizer, DCP: every rank's files)  trainer.*  meta.json   (FSDP)
  step-000300.tmp/   a save in progress (or killed): never read
  latest             name of the newest complete checkpoint
  best               name of the checkpoint with the lowest val loss
"""

from __future__ import annotations

import re
from pathlib import Path

import xxhash

MODEL_FILE = "model.safetensors"
TRAINER_FILE = "trainer.pt"  # optimizer, schedule, RNG and data cursor, with its tensors in TRAINER_TENSORS
TRAINER_TENSORS = "trainer.safetensors"
META_FILE = "meta.json"
SHARDS_DIR = "shards"  # FSDP: {"model": ..., "optimizer": ...} through DCP, the files each rank wrote
OPTIMIZER_DIR = "optimizer"  # FSDP checkpoints of earlier versions: the optimizer alone (weights in MODEL_FILE)
LATEST = "latest"
BEST = "best"
_STEP_DIR = re.compile(r"^step-(\d{6,})$")

# xxh3-128 detects torn and corrupted files at memory speed; sha256 would make loading CPU-bound.
CHECKSUM = "xxh3_128"


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def tmp_dir(root: Path, step: int) -> Path:
    return root / f"{step_name(step)}.tmp"


def file_digest(path: Path) -> str:
    h = xxhash.xxh3_128()
    buf = bytearray(16 << 20)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def pointer(root: Path, which: str) -> str | None:
    """The checkpoint folder name `latest`/`best` holds; None without one, or for anything but a step-N name
    (a pointer copied from elsewhere must not lead out of the folder)."""
    try:
        name = (root / which).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return name if _STEP_DIR.match(name) else None


def complete_checkpoints(root: Path) -> list[Path]:
    """Finished checkpoint folders (not .tmp), oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))  # type: ignore[union-attr]


def is_checkpoint_dir(path: Path) -> bool:
    """A checkpoint folder (not a run folder): its meta.json and its weights, whole or in shards."""
    return (path / META_FILE).is_file() and ((path / MODEL_FILE).exists() or (path / SHARDS_DIR).is_dir())

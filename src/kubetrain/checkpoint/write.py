"""Checkpoints that never lose work: written to a temporary folder, fsynced, renamed; verified on load.

checkpoints/
  step-000200/ model.safetensors  trainer.pt  meta.json (step, tokens, losses, config hash, checksums)
  latest       name of the newest complete checkpoint
  best         name of the checkpoint with the lowest val loss
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash
from safetensors import SafetensorError
from safetensors.torch import load_file

from kubetrain.checkpoint import tensorfile
from kubetrain.errors import CheckpointError, IncompatibleCheckpointError
from kubetrain.runs import write_atomic

MODEL_FILE = "model.safetensors"
TRAINER_FILE = "trainer.pt"  # optimizer, schedule, RNG and data cursor, with its tensors in TRAINER_TENSORS
TRAINER_TENSORS = "trainer.safetensors"
META_FILE = "meta.json"
LATEST = "latest"
BEST = "best"
_STEP_DIR = re.compile(r"^step-(\d{6,})$")


def step_name(step: int) -> str:
    return f"step-{step:06d}"


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    meta: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    def model_state(self) -> dict[str, torch.Tensor]:
        return load_file(self.path / MODEL_FILE)

    def trainer_state(self) -> dict[str, Any]:
        # weights_only: a checkpoint from elsewhere cannot run code when it is loaded.
        # mmap: tensors are paged in from the file (already in the page cache after verify) instead of copied.
        skeleton = torch.load(self.path / TRAINER_FILE, map_location="cpu", weights_only=True)
        tensors = load_file(self.path / TRAINER_TENSORS) if (self.path / TRAINER_TENSORS).exists() else {}
        state: dict[str, Any] = tensorfile.join(skeleton, tensors)
        return state


def unique_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies, each storage once (tied weights are saved under their first name)."""
    seen: set[tuple[int, int]] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), int(t.storage_offset()))
        if t.numel() and key in seen:
            continue
        seen.add(key)
        out[name] = t.detach().to("cpu").contiguous()
    return out


# xxh3-128 detects torn and corrupted files at memory speed; sha256 would make loading CPU-bound.
CHECKSUM = "xxh3_128"


def file_digest(path: Path) -> str:
    h = xxhash.xxh3_128()
    buf = bytearray(16 << 20)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems do not fsync directories
        _fsync_file(path)


def save(
    root: Path,
    step: int,
    model_state: dict[str, torch.Tensor],
    trainer_state: dict[str, Any],
    meta: dict[str, Any],
    *,
    keep_last: int,
    is_best: bool = False,
    prepared: bool = False,
) -> Checkpoint:
    """Write one checkpoint atomically, move `latest` (and `best`) to it, prune old ones.

    A failure at any point (full disk, no permission, a kill) leaves the previous checkpoint and the
    `latest` pointer as they were. `prepared`: the caller made the temporary folder with `begin` and
    wrote more into it (sharded optimizer state); those files are checksummed too.
    """
    name = step_name(step)
    final = root / name
    tmp = tmp_dir(root, step)
    try:
        if not prepared:
            begin(root, step)
        tensors = unique_tensors(model_state)
        written = {MODEL_FILE: tensorfile.write(tmp / MODEL_FILE, tensors)}
        # The big optimizer tensors go to a safetensors file at disk speed; trainer.pt keeps the small rest.
        trainer_tensors: dict[str, torch.Tensor] = {}
        skeleton = tensorfile.split(trainer_state, trainer_tensors)
        written[TRAINER_TENSORS] = tensorfile.write(tmp / TRAINER_TENSORS, trainer_tensors)
        torch.save(skeleton, tmp / TRAINER_FILE)
        files = sorted(f for f in tmp.rglob("*") if f.is_file() and f.name != META_FILE)
        others = [f for f in files if str(f.relative_to(tmp)) not in written]
        # The rest (trainer.pt, sharded optimizer files) is hashed and fsynced at once: both release the GIL.
        with ThreadPoolExecutor(max_workers=4) as pool:
            written.update(zip((str(f.relative_to(tmp)) for f in others), pool.map(_digest_and_sync, others),
                               strict=True))
        digests = [written[str(f.relative_to(tmp))] for f in files]
        full_meta = {
            **meta,
            "step": step,
            "files": {
                str(f.relative_to(tmp)): {CHECKSUM: d, "bytes": f.stat().st_size}
                for f, d in zip(files, digests, strict=True)
            },
            "shapes": {k: list(v.shape) for k, v in tensors.items()},
        }
        write_atomic(tmp / META_FILE, json.dumps(full_meta, indent=2))
        _fsync_dir(tmp)
        if final.exists():  # an earlier save of the same step (a resumed run re-saving): replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
        write_atomic(root / LATEST, name + "\n")
        if is_best:
            write_atomic(root / BEST, name + "\n")
        _fsync_dir(root)
    except (OSError, RuntimeError, SafetensorError) as e:
        # torch.save reports a full disk as RuntimeError and safetensors as SafetensorError.
        shutil.rmtree(tmp, ignore_errors=True)
        why = os.strerror(e.errno) if isinstance(e, OSError) and e.errno else str(e).splitlines()[0]
        raise CheckpointError(
            f"could not save checkpoint {name} in {root}: {why}; the previous checkpoint is intact"
        ) from None
    prune(root, keep_last)
    return Checkpoint(final, full_meta)


def tmp_dir(root: Path, step: int) -> Path:
    return root / f"{step_name(step)}.tmp"


def begin(root: Path, step: int) -> Path:
    """A fresh temporary folder for the checkpoint of `step` (what a killed save left there is discarded)."""
    tmp = tmp_dir(root, step)
    root.mkdir(parents=True, exist_ok=True)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def _digest_and_sync(path: Path) -> str:
    digest = file_digest(path)
    _fsync_file(path)
    return digest


def pointer(root: Path, which: str) -> str | None:
    try:
        name = (root / which).read_text().strip()
    except OSError:
        return None
    return name or None


def complete_checkpoints(root: Path) -> list[Path]:
    """Finished checkpoint folders (not .tmp), oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))  # type: ignore[union-attr]


def prune(root: Path, keep_last: int) -> None:
    """Keep the newest `keep_last` checkpoints, plus the ones `latest` and `best` name."""
    keep = {pointer(root, LATEST), pointer(root, BEST)}
    ckpts = complete_checkpoints(root)
    for p in ckpts[: max(0, len(ckpts) - keep_last)]:
        if p.name not in keep:
            shutil.rmtree(p, ignore_errors=True)
    for p in root.glob("*.tmp"):  # leftovers of a save that was killed
        shutil.rmtree(p, ignore_errors=True)


def verify(path: Path, deep: bool = True) -> Checkpoint:
    """The checkpoint in `path` if its meta and files are whole and match their checksums."""
    try:
        meta = json.loads((path / META_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path.name}: unreadable meta.json ({e})") from None
    files = meta.get("files") or {}
    if not files:
        raise CheckpointError(f"{path.name}: meta.json lists no files")
    for fname, info in files.items():
        f = path / fname
        if not f.is_file():
            raise CheckpointError(f"{path.name}: {fname} is missing")
        if f.stat().st_size != info["bytes"]:
            raise CheckpointError(f"{path.name}: {fname} has {f.stat().st_size} bytes, expected {info['bytes']}")
    if deep:
        with ThreadPoolExecutor(max_workers=len(files)) as pool:
            digests = dict(zip(files, pool.map(file_digest, (path / f for f in files)), strict=True))
        for fname, info in files.items():
            if digests[fname] != info.get(CHECKSUM):
                raise CheckpointError(f"{path.name}: {fname} fails its checksum")
    return Checkpoint(path, meta)


def find_resumable(root: Path, warn: Callable[[str], None] | None = None) -> Checkpoint | None:
    """The newest checkpoint that verifies; broken or half-written ones are skipped with a warning.

    Newest by step, not by the `latest` pointer: a kill between the rename and the pointer update leaves
    a complete checkpoint that `latest` does not name yet.
    """
    warn = warn or (lambda m: warnings.warn(m, stacklevel=2))
    for path in reversed(complete_checkpoints(root)):
        try:
            return verify(path)
        except CheckpointError as e:
            warn(f"skipping checkpoint {e}")
    return None


def resolve(path: Path) -> Checkpoint:
    """A checkpoint named by the user: a checkpoint folder, or a run/checkpoints folder (its newest good one)."""
    if (path / META_FILE).is_file() and (path / MODEL_FILE).exists():
        return verify(path)
    for root in (path / "checkpoints", path):
        if root.is_dir() and complete_checkpoints(root):
            found = find_resumable(root)
            if found:
                return found
    raise IncompatibleCheckpointError(f"no usable checkpoint at {path}")


def check_compatible(ckpt: Checkpoint, shapes: dict[str, list[int]], tokenizer: str | None) -> None:
    """Refuse a checkpoint whose model shape or tokenizer differs from the config's."""
    theirs = ckpt.meta.get("shapes", {})
    for name, shape in theirs.items():
        if name in shapes and shapes[name] != shape:
            raise IncompatibleCheckpointError(
                f"checkpoint {ckpt.path} does not fit the model: {name} is {shape} there, {shapes[name]} in the config"
            )
    if set(theirs) != set(shapes):
        differ = sorted(set(theirs) ^ set(shapes))
        raise IncompatibleCheckpointError(
            f"checkpoint {ckpt.path} does not fit the model: weights differ ({', '.join(differ[:3])})"
        )
    old_tok = ckpt.meta.get("tokenizer")
    if tokenizer and old_tok and old_tok != tokenizer:
        raise IncompatibleCheckpointError(
            f"checkpoint {ckpt.path} was trained with tokenizer {old_tok}, the config gives {tokenizer}"
        )

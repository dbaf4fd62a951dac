"""Read checkpoints back: verify every file against its checksum, pick the newest that verifies, check fit.

A checkpoint's files are hashed once, by the first process that verifies it, which records the verdict for the
other ranks and later starts (checkpoint/verdict.py).

Nothing here unpickles anything but plain data: weights come from safetensors, the trainer state through
`torch.load(weights_only=True)`.
"""

from __future__ import annotations

import json
import pickle
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from kubetrain.checkpoint import diverged, tensorfile, verdict
from kubetrain.checkpoint.layout import (
    META_FILE,
    MODEL_FILE,
    SHARDS_DIR,
    TRAINER_FILE,
    TRAINER_TENSORS,
    complete_checkpoints,
    is_checkpoint_dir,
)
from kubetrain.errors import BadCheckpointError, CheckpointError, IncompatibleCheckpointError, NoCheckpointVerifies
from kubetrain.outside_names import OutsideName, join_inside


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    meta: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    def model_state(self) -> dict[str, torch.Tensor]:
        """Every saved weight, whole: from model.safetensors, or assembled from an FSDP checkpoint's shards."""
        if (self.path / MODEL_FILE).exists():
            return load_file(self.path / MODEL_FILE)
        from kubetrain.checkpoint.sharded import consolidated_model

        return consolidated_model(self.path)

    @property
    def sharded(self) -> bool:
        """Its model and optimizer are DCP shards (an FSDP checkpoint of this version)."""
        return (self.path / SHARDS_DIR).is_dir()

    def trainer_state(self) -> dict[str, Any]:
        skeleton = load_trainer_skeleton(self.path)
        tensors = load_file(self.path / TRAINER_TENSORS) if (self.path / TRAINER_TENSORS).exists() else {}
        state: dict[str, Any] = tensorfile.join(skeleton, tensors)
        return state


def load_trainer_skeleton(path: Path) -> Any:
    """trainer.pt of the checkpoint in `path`: plain data only, or CheckpointError.

    weights_only: a checkpoint from elsewhere cannot run code when it is loaded. A file whose checksum matches but
    which holds more than plain data (a pickle of objects, its digest updated to match) is a corrupt checkpoint.
    """
    try:
        return torch.load(path / TRAINER_FILE, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, TypeError, AttributeError) as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path.name}: {TRAINER_FILE} is not plain data that loads safely ({why})") from None


def verify(path: Path, deep: bool = True) -> Checkpoint:
    """The checkpoint in `path` if its meta and files are whole and match their checksums.

    `deep` also hashes every file and loads trainer.pt the safe way (it is small: its tensors are elsewhere).
    """
    try:
        meta = json.loads((path / META_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path.name}: unreadable meta.json ({e})") from None
    files = meta.get("files") or {}
    if not isinstance(files, dict) or not files:
        raise CheckpointError(f"{path.name}: meta.json lists no files")
    for fname, info in files.items():
        f = inside_checkpoint(path, fname)
        if not f.is_file():
            raise CheckpointError(f"{path.name}: {fname} is missing")
        if f.stat().st_size != info["bytes"]:
            raise CheckpointError(f"{path.name}: {fname} has {f.stat().st_size} bytes, expected {info['bytes']}")
    if deep:
        problem = verdict.hashed(path, files)
        if problem:
            raise CheckpointError(f"{path.name}: {problem}")
        if TRAINER_FILE in files:
            load_trainer_skeleton(path)
    return Checkpoint(path, meta)


def inside_checkpoint(path: Path, fname: str) -> Path:
    """path/fname for a file name that meta.json lists; CheckpointError for one outside the checkpoint folder."""
    try:
        return join_inside(path, fname)
    except OutsideName as e:
        raise CheckpointError(f"{path.name}: meta.json names {fname!r}, not a file inside the checkpoint "
                              f"({e.why})") from None


def verify_named(path: Path) -> Checkpoint:
    """`verify` for a checkpoint the user named: one that does not verify is bad input (BadCheckpointError)."""
    try:
        return verify(path)
    except CheckpointError as e:
        why = str(e).removeprefix(f"{path.name}: ")
        raise BadCheckpointError(f"checkpoint {path} does not verify: {why}") from None


def find_resumable(root: Path, warn: Callable[[str], None] | None = None) -> Checkpoint | None:
    """The newest checkpoint that verifies; broken or half-written ones are skipped with a warning.

    Newest by step, not by the `latest` pointer: a kill between the rename and the pointer update leaves
    a complete checkpoint that `latest` does not name yet. None when there is no checkpoint at all; when there
    are some and none verifies, NoCheckpointVerifies: starting from step 0 would overwrite them.
    """
    warn = warn or (lambda m: warnings.warn(m, stacklevel=2))
    found = complete_checkpoints(root)
    bad = diverged.diverged(root)
    for path in reversed(found):
        if path.name in bad:
            warn(f"skipping checkpoint {path.name}: its weights gave a loss that was not finite (the run stopped "
                 f"there); --resume {path} takes it anyway")
            continue
        try:
            return verify(path)
        except CheckpointError as e:
            warn(f"skipping checkpoint {e}")
    if found and all(p.name in bad for p in found):
        raise NoCheckpointVerifies(
            f"every checkpoint in {root} holds weights that gave a loss that was not finite: start afresh under "
            "another run.name (--set run.name=NEW) with a lower train.lr, or --resume one of them by its path")
    if found:
        raise NoCheckpointVerifies(
            f"none of the {len(found)} checkpoints in {root} verifies: the run would start again from step 0 and "
            f"overwrite them; nothing was changed: repair or move them away, or start afresh under another run.name"
        )
    return None


def resolve(path: Path) -> Checkpoint:
    """A checkpoint named by the user: a checkpoint folder, or a run/checkpoints folder (its newest good one)."""
    if is_checkpoint_dir(path):
        return verify_named(path)
    for root in (path / "checkpoints", path):
        if root.is_dir() and complete_checkpoints(root):
            try:
                found = find_resumable(root)
            except NoCheckpointVerifies:
                continue
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

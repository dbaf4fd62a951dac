"""Read torch.distributed.checkpoint (DCP) files without letting them run code.

DCP's own reader unpickles `.metadata` with `pickle.load`, and its load planner reads every non-tensor value
with `torch.load(weights_only=False)`: a checkpoint from elsewhere could run anything. Two guards:
- the files under `shards/` (or `optimizer/`, earlier checkpoints) must match the xxh3-128 digests the
  checkpoint's meta.json recorded when they were written (no file missing, none added). This catches a
  corrupted or tampered shard, but an attacker who forges the whole checkpoint forges meta.json too;
- so the real guarantee is the loading itself: `.metadata` goes through an unpickler that knows only DCP's
  metadata classes, and non-tensor values only through `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from kubetrain.checkpoint import verdict
from kubetrain.checkpoint.layout import META_FILE
from kubetrain.errors import CheckpointError

# What DCP's metadata pickle names (torch 2.4 to 2.13): its dataclasses, the file index, tensor shapes and dtypes.
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a layout by its name ("torch.strided")
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath"},  # StorageMeta.checkpoint_id
}


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and nothing else: any other class or function is refused, never imported."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype | torch.layout):
            return getattr(torch, name)  # torch.float32, torch.strided: values, not code
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


def load_metadata(path: Path) -> Metadata:
    """The DCP metadata in `path`, unpickled with MetadataUnpickler; CheckpointError when it is anything else."""
    try:
        with open(path, "rb") as f:
            metadata = MetadataUnpickler(f).load()
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
        raise CheckpointError(f"refusing to load {path}: {e}") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"refusing to load {path}: it holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with `.metadata` read by `load_metadata` instead of `pickle.load`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        metadata = load_metadata(Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata"))
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id  # as FileSystemReader.read_metadata does
        metadata.storage_meta = storage_meta
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, but a non-tensor value (lr, betas, ...) loads only as plain data."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        plain = torch.load(value, map_location="cpu", weights_only=True)  # refuses anything that is code
        # The parent's torch.load(weights_only=False) then only ever sees what we serialised ourselves.
        clean = io.BytesIO()
        torch.save(plain, clean)
        clean.seek(0)
        super().load_bytes(read_item, clean)


def verify_files(checkpoint_dir: Path, folder: str) -> None:
    """Every file under checkpoint_dir/folder is listed in the checkpoint's meta.json and matches its digest."""
    try:
        listed = json.loads((checkpoint_dir / META_FILE).read_text()).get("files") or {}
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{checkpoint_dir.name}: unreadable meta.json ({e})") from None
    root = checkpoint_dir / folder
    present = {str(f.relative_to(checkpoint_dir)) for f in root.rglob("*") if f.is_file()}
    expected = {name for name in listed if name.startswith(f"{folder}/")}
    if not present:
        raise CheckpointError(f"{checkpoint_dir.name}: {folder}/ is missing or empty")
    if present != expected:
        odd = sorted(present ^ expected)
        raise CheckpointError(f"{checkpoint_dir.name}: {folder}/ does not match meta.json ({', '.join(odd[:3])})")
    # every listed file's digest, hashed once per checkpoint: by now it usually has its verdict from the resume
    problem = verdict.hashed(checkpoint_dir, listed)
    if problem:
        raise CheckpointError(f"{checkpoint_dir.name}: {problem}")

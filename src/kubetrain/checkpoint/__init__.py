"""The checkpoint format: layout, write, verify, read, newest-that-verifies, FSDP shards (checkpoint.sharded); copies in
object storage (`checkpoint.remote`, `checkpoint.sync`).

Callers say `from kubetrain import checkpoint` and `checkpoint.save(...)`, `checkpoint.find_resumable(...)`.
Nothing here imports from train/, models/, cli/ or k8s/: every one of them imports this.
"""

import importlib
from typing import TYPE_CHECKING, Any

from kubetrain.checkpoint.layout import (
    BEST,
    CHECKSUM,
    LATEST,
    META_FILE,
    MODEL_FILE,
    OPTIMIZER_DIR,
    SHARDS_DIR,
    TRAINER_FILE,
    TRAINER_TENSORS,
    complete_checkpoints,
    file_digest,
    is_checkpoint_dir,
    pointer,
    step_name,
    tmp_dir,
)

if TYPE_CHECKING:
    from kubetrain.checkpoint.read import Checkpoint, check_compatible, find_resumable, resolve, verify
    from kubetrain.checkpoint.write import BackgroundSaver, Saved, begin, prune, save, stage, unique_tensors

# read and write import torch (and write torch.distributed.checkpoint, ~0.6 s): they load on first use, so that
# what needs only the layout (`kubetrain runs list`, `k8s render`) starts without torch.
_TORCH_MODULES = {
    **dict.fromkeys(("Checkpoint", "check_compatible", "find_resumable", "resolve", "verify"), "read"),
    **dict.fromkeys(("BackgroundSaver", "Saved", "begin", "prune", "save", "stage", "unique_tensors"), "write"),
}


def __getattr__(name: str) -> Any:
    """`checkpoint.save` and the rest of read.py/write.py, imported the first time one is asked for."""
    module = _TORCH_MODULES.get(name)
    if module is None:  # AttributeError, which also lets `from kubetrain.checkpoint import verdict` find the module
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "BEST",
    "CHECKSUM",
    "LATEST",
    "META_FILE",
    "MODEL_FILE",
    "OPTIMIZER_DIR",
    "SHARDS_DIR",
    "TRAINER_FILE",
    "TRAINER_TENSORS",
    "BackgroundSaver",
    "Checkpoint",
    "Saved",
    "begin",
    "check_compatible",
    "complete_checkpoints",
    "file_digest",
    "find_resumable",
    "is_checkpoint_dir",
    "pointer",
    "prune",
    "resolve",
    "save",
    "stage",
    "step_name",
    "tmp_dir",
    "unique_tensors",
    "verify",
]

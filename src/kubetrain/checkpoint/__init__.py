"""The checkpoint format: layout, write, verify, read, newest-that-verifies, FSDP shards (checkpoint.sharded); copies in
object storage (`checkpoint.remote`, `checkpoint.sync`).

Callers say `from kubetrain import checkpoint` and `checkpoint.save(...)`, `checkpoint.find_resumable(...)`.
Nothing here imports from train/, models/, cli/ or k8s/: every one of them imports this.
"""

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
from kubetrain.checkpoint.read import Checkpoint, check_compatible, find_resumable, resolve, verify
from kubetrain.checkpoint.write import BackgroundSaver, Saved, begin, prune, save, stage, unique_tensors

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

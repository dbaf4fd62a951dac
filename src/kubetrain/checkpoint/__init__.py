"""The checkpoint format: layout, write, verify, read, newest-that-verifies, sharded optimizer state.

Callers say `from kubetrain import checkpoint` and `checkpoint.save(...)`, `checkpoint.find_resumable(...)`.
Nothing here imports from train/, models/, cli/ or k8s/: every one of them imports this.
"""

from kubetrain.checkpoint.sharded import OPTIMIZER_DIR, full_model_state, load_optimizer, save_optimizer
from kubetrain.checkpoint.write import (
    BEST,
    CHECKSUM,
    LATEST,
    META_FILE,
    MODEL_FILE,
    TRAINER_FILE,
    TRAINER_TENSORS,
    Checkpoint,
    begin,
    check_compatible,
    complete_checkpoints,
    file_digest,
    find_resumable,
    pointer,
    prune,
    resolve,
    save,
    step_name,
    tmp_dir,
    unique_tensors,
    verify,
)

__all__ = [
    "BEST",
    "CHECKSUM",
    "LATEST",
    "META_FILE",
    "MODEL_FILE",
    "OPTIMIZER_DIR",
    "TRAINER_FILE",
    "TRAINER_TENSORS",
    "Checkpoint",
    "begin",
    "check_compatible",
    "complete_checkpoints",
    "file_digest",
    "find_resumable",
    "full_model_state",
    "load_optimizer",
    "pointer",
    "prune",
    "resolve",
    "save",
    "save_optimizer",
    "step_name",
    "tmp_dir",
    "unique_tensors",
    "verify",
]

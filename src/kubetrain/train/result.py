"""How a run ended: the result `train` returns (and `--json` prints), and its record in the run's meta.json."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kubetrain import runs
from kubetrain.checkpoint import Checkpoint
from kubetrain.train.state import TrainState


@dataclass
class TrainResult:
    run_dir: str
    steps: int
    tokens: int
    final_train_loss: float | None
    final_val_loss: float | None
    best_val_loss: float | None
    tokens_per_second: float
    status: str
    resumed_from: int | None = None
    sample: str | None = None
    checkpoint: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def of_run(cls, run_dir: Path, state: TrainState, status: str, *, start_step: int, resumed: bool,
               trained_tokens: int, training_seconds: float, sample: str | None,
               last_checkpoint: Checkpoint | None) -> TrainResult:
        """The result of a run that started (or resumed) at `start_step` and trained `trained_tokens` since."""
        return cls(
            run_dir=str(run_dir.resolve()),
            steps=state.step,
            tokens=state.tokens,
            final_train_loss=state.last_train_loss,
            final_val_loss=state.last_val_loss,
            best_val_loss=state.best_val_loss,
            tokens_per_second=trained_tokens / training_seconds if training_seconds > 0 else 0.0,
            status=status,
            resumed_from=start_step if resumed else None,
            sample=sample,
            checkpoint=str(last_checkpoint.path.resolve()) if last_checkpoint else None,
        )


def record_end(run_dir: Path, state: TrainState, status: str, say: Callable[[str], None]) -> None:
    """Rank 0: how the run ended, into meta.json (a failure to write it is a warning: the error that ends the run
    matters more than this record of it)."""
    if not run_dir.exists():
        return
    try:
        runs.update_meta(run_dir, status=status, step=state.step, tokens=state.tokens,
                         best_val_loss=state.best_val_loss, final_val_loss=state.last_val_loss,
                         final_train_loss=state.last_train_loss, finished_at=time.time())
    except OSError as e:
        say(f"warning: could not record the end of the run ({status}) in meta.json: {e}")

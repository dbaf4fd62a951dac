"""TensorBoard event files: train and eval scalars, and the resolved config as text."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

from kubetrain.secrets import redact
from kubetrain.track import Sink
from kubetrain.track.failures import missing_package

TRAIN_SCALARS = ("loss", "lr", "tokens", "tokens_per_second", "mfu", "memory_gib")
EVAL_SCALARS = ("val_loss", "val_ppl")


class TensorboardSink(Sink):
    name = "tensorboard"

    def __init__(self, root: Path | None = None, stream: Any = None) -> None:
        self.root = root
        self.stream = stream
        self.writer: Any = None

    def start(self, info: dict[str, Any]) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise missing_package("tensorboard") from None
        log_dir = Path(info["run_dir"]) / "tensorboard"
        if self.root is not None:  # one shared root: a folder per run (and phase), as TensorBoard expects
            log_dir = self.root / str(info.get("run") or "run") / (info.get("phase") or "")
        start_step = int(info.get("start_step", 0))
        # purge_step hides events past the checkpoint a resume starts from, as metrics.jsonl drops them
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=start_step or None, flush_secs=10)
        cfg = info.get("config")
        if cfg is not None and not start_step:
            text = yaml.safe_dump(redact(cfg.model_dump(mode="json")), sort_keys=False)
            # indented four spaces: TensorBoard renders text as Markdown, and this keeps it a code block
            self.writer.add_text("config", "\n".join("    " + line for line in text.splitlines()), 0)
        print(f"tensorboard: events in {log_dir}", file=self.stream or sys.stdout, flush=True)

    def log(self, record: dict[str, Any]) -> None:
        kind = record.get("kind")
        names = TRAIN_SCALARS if kind == "train" else EVAL_SCALARS if kind == "eval" else ()
        for name in names:
            value = record.get(name)
            if value is not None:
                self.writer.add_scalar(f"{kind}/{name}", float(value), int(record["step"]),
                                       walltime=record.get("time"))
        if kind == "eval":
            self.writer.flush()  # evaluations are rare and the ones people wait for

    def finish(self, status: str) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

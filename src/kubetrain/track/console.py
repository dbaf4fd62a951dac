"""Progress on stdout: a rich progress line on a terminal, plain lines otherwise."""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable
from typing import Any

from kubetrain.secrets import redact_text
from kubetrain.track import Sink

# The fields of a `train` line that parse_progress reads back (the same text format_record writes).
_STEP = re.compile(r"\bstep (\d+)/(\d+)\b")
_RATE = re.compile(r"\btok/s ([\d,]+)")
_ETA = re.compile(r"\beta (?:(\d+):)?(\d+):(\d\d)\b")
_SLOWEST = re.compile(r"\bslowest rank (\d+) \((\d+(?:\.\d+)?)x\)")
# The checkpoint line (checkpoint_line), read back by `k8s doctor` from a pod's log (checkpoint_in)
_SAVED = re.compile(r"\bcheckpoint at step (\d+) written in (\d+(?:\.\d+)?)s\b")


def format_record(rec: dict[str, Any], total: int) -> str:
    if rec["kind"] == "eval":
        return f"eval step {rec['step']}: val_loss {rec['val_loss']:.4f} ppl {rec['val_ppl']:.2f}"
    parts = [
        f"step {rec['step']}/{total}",
        f"loss {rec['loss']:.4f}",
        f"lr {rec['lr']:.2e}",
        f"tok/s {rec['tokens_per_second']:,.0f}",
    ]
    if rec.get("mfu") is not None:
        parts.append(f"mfu {100 * rec['mfu']:.1f}%")
    parts.append(f"mem {rec['memory_gib']:.2f}GiB")
    if rec.get("slowest_rank") is not None:  # distributed runs: the rank the others wait for
        parts.append(f"slowest rank {rec['slowest_rank']} ({rec['straggler_ratio']:.1f}x)")
    if rec.get("eta_seconds") is not None:
        parts.append(f"eta {duration(rec['eta_seconds'])}")
    return " | ".join(parts)


def parse_progress(line: str) -> dict[str, Any] | None:
    """What a `train` line of `format_record` says (step, max_steps, tokens_per_second, eta_seconds, slowest_rank,
    straggler_ratio; None where the line has none), or None for any other line. `k8s status` reads pod logs so."""
    step = _STEP.search(line)
    if step is None:
        return None
    rate, eta, slowest = _RATE.search(line), _ETA.search(line), _SLOWEST.search(line)
    return {
        "step": int(step.group(1)),
        "max_steps": int(step.group(2)),
        "tokens_per_second": float(rate.group(1).replace(",", "")) if rate else None,
        "eta_seconds": (int(eta.group(1) or 0) * 3600 + int(eta.group(2)) * 60 + int(eta.group(3))) if eta else None,
        "slowest_rank": int(slowest.group(1)) if slowest else None,
        "straggler_ratio": float(slowest.group(2)) if slowest else None,
    }


def checkpoint_line(step: int, write_seconds: float, blocked_seconds: float) -> str:
    """`checkpoint at step 400 written in 61.93s (training blocked 0.41s)`: no `step N/M`, so not progress."""
    return f"checkpoint at step {step} written in {write_seconds:.2f}s (training blocked {blocked_seconds:.2f}s)"


def checkpoint_in(line: str) -> tuple[int, float] | None:
    """(step, write_seconds) of a line `checkpoint_line` wrote, or None for any other line."""
    found = _SAVED.search(line)
    return (int(found.group(1)), float(found.group(2))) if found else None


def count(n: int) -> str:
    """A parameter count a reader takes in at once: 15.4K, 0.90M, 124.44M, 1.24B (LoRA adapters are not 0.00M)."""
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    if n >= 1e5:
        return f"{n / 1e6:.2f}M"
    if n >= 1e3:
        return f"{n / 1e3:.1f}K"
    return str(n)


def duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def console_log(prefix: str = "", stream: Any = None) -> Callable[[str], None]:
    """The training log on stdout: each line prefixed (the rank, when there are several) and secrets redacted."""

    def say(message: str) -> None:
        print(prefix + redact_text(message), file=stream or sys.stdout, flush=True)

    return say


class ConsoleSink(Sink):
    name = "console"

    def __init__(
        self, total_steps: int, stream: Any = None, rich_progress: bool | None = None, prefix: str = ""
    ) -> None:
        self.total = total_steps
        self.prefix = prefix
        self.stream = stream or sys.stdout
        self.rich = self.stream.isatty() if rich_progress is None else rich_progress
        self.progress: Any = None
        self.task: Any = None

    def start(self, info: dict[str, Any]) -> None:
        if self.rich:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[line]}"),
                TimeRemainingColumn(),
                console=Console(file=self.stream),
                transient=False,
            )
            self.progress.start()
            self.task = self.progress.add_task("train", total=self.total, completed=info.get("start_step", 0), line="")

    def log(self, record: dict[str, Any]) -> None:
        if record["kind"] not in ("train", "eval"):
            return
        line = redact_text(format_record(record, self.total))
        if self.progress is not None:
            if record["kind"] == "eval":
                self.progress.console.print(line)
            else:
                self.progress.update(self.task, completed=record["step"], line=line.split(" | ", 1)[1])
        else:
            print(self.prefix + line, file=self.stream, flush=True)

    def finish(self, status: str) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


class Throughput:
    """Tokens per second over the last logging window, and ETA from it."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.tokens0 = 0

    def restart(self, tokens: int) -> None:
        """Start the window afresh now, at `tokens` (after a first step that compiled and warmed up)."""
        self.t0, self.tokens0 = time.perf_counter(), tokens

    def window(self, tokens: int) -> tuple[float, float]:
        now = time.perf_counter()
        dt = max(now - self.t0, 1e-9)
        rate = (tokens - self.tokens0) / dt
        self.t0, self.tokens0 = now, tokens
        return rate, dt

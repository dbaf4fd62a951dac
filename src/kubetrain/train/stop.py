"""Graceful stop: the first SIGTERM/SIGINT asks the loop to finish its step and checkpoint; a second exits at once.

Exiting at once is safe because every file a checkpoint writes is renamed into place: `latest` always names
a complete checkpoint. When the grace period ends before the stop checkpoint is written, the process exits
75 (resumable), naming the step the run will resume from, or saying that no checkpoint exists yet: a stop before
the first checkpoint loses nothing that a restart would not redo, and is no failure (a Job's podFailurePolicy
ignores 75; counting it failed jobs that had lost nothing). StopVote makes every rank stop at the same step without
a GPU synchronisation.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as td

from kubetrain.checkpoint.layout import LATEST, pointer
from kubetrain.errors import EXIT_STOPPED_RESUMABLE, resume_hint


class GracefulStop:
    def __init__(self, grace_seconds: float, checkpoints: Path | None = None) -> None:
        self.grace_seconds = grace_seconds
        self.checkpoints = checkpoints  # where an earlier complete checkpoint makes a late stop resumable
        self.requested = False
        self.signal_name: str | None = None
        self.requested_at: float | None = None
        self._previous: dict[int, object] = {}
        self._watchdog: threading.Timer | None = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.requested:
            print(f"\n{name} again: exiting now (the last complete checkpoint stays 'latest')",
                  file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.requested, self.signal_name, self.requested_at = True, name, time.monotonic()
        rank = f"[rank {os.environ['RANK']}] " if "RANK" in os.environ else ""  # each worker gets the signal
        print(
            f"\n{rank}{name}: finishing this step and saving a checkpoint (up to {self.grace_seconds:.0f}s); "
            "send it again to exit at once",
            file=sys.stderr,
            flush=True,
        )
        # If the save cannot finish within the grace period, leave rather than be killed mid-way by the caller.
        self._watchdog = threading.Timer(self.grace_seconds, self._expire)
        self._watchdog.daemon = True
        self._watchdog.start()

    def _expire(self) -> None:
        latest = pointer(self.checkpoints, LATEST) if self.checkpoints is not None else None
        if latest is not None:
            print(f"grace period of {self.grace_seconds:.0f}s passed before the stop checkpoint was saved; exiting: "
                  f"the run resumes from {latest} (its newest complete checkpoint)", file=sys.stderr, flush=True)
            os._exit(EXIT_STOPPED_RESUMABLE)
        print(f"grace period of {self.grace_seconds:.0f}s passed before the first checkpoint was saved: nothing to "
              f"lose, the run starts over; exiting {EXIT_STOPPED_RESUMABLE} ({resume_hint()})",
              file=sys.stderr, flush=True)
        os._exit(EXIT_STOPPED_RESUMABLE)

    def time_left(self) -> float | None:
        """Seconds left of the grace period since the stop was asked for; None when no stop was asked for."""
        if self.requested_at is None:
            return None
        return max(0.0, self.grace_seconds - (time.monotonic() - self.requested_at))

    def done(self) -> None:
        """The stop checkpoint is saved: the watchdog is no longer needed."""
        if self._watchdog is not None:
            self._watchdog.cancel()

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        self.done()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]


class StopVote:
    """Whether any rank was asked to stop, agreed by every rank at the same step, without blocking on the GPU.

    Each step posts this rank's flag in an asynchronous all-reduce (MAX) over a CPU (gloo) group and reads the
    vote posted one step earlier, which has had a whole step to arrive: no GPU synchronisation (a CUDA tensor's
    .item() would wait for every kernel queued so far, so the CPU could never run ahead of the GPU), and no
    blocking wait in the common case. A stop asked for during step s is acted on after step s + 1, on every
    rank at the same step. One process: the flag itself, at once.
    """

    def __init__(self, group: Any = None, distributed: bool = False) -> None:
        self.group, self.distributed = group, distributed
        self._pending: tuple[Any, torch.Tensor] | None = None

    @classmethod
    def for_world(cls) -> StopVote:
        """A vote over every rank of the default group (a collective call: every rank makes it)."""
        if not td.is_initialized() or td.get_world_size() == 1:
            return cls()
        # a gloo default group already runs on the CPU; under NCCL the vote gets a gloo group of its own
        group = None if td.get_backend() == "gloo" else td.new_group(backend="gloo")
        return cls(group, distributed=True)

    def poll(self, requested: bool) -> bool:
        """Post this rank's flag; True when the vote posted at the previous call says some rank asked to stop."""
        if not self.distributed:
            return requested
        agreed = self._collect()
        flag = torch.tensor([1 if requested else 0], dtype=torch.int32)
        self._pending = (td.all_reduce(flag, op=td.ReduceOp.MAX, group=self.group, async_op=True), flag)
        return agreed

    def close(self) -> None:
        """Wait for the vote still in flight, so no rank leaves a collective behind."""
        self._collect()

    def _collect(self) -> bool:
        if self._pending is None:
            return False
        work, flag = self._pending
        self._pending = None
        work.wait()
        return bool(flag.item())

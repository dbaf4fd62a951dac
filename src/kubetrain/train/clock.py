"""The run's clocks: tokens/s of each logging window, the ETA, and the training time the result reports.

The first step (compilation, warm-up, the allocator's first blocks) counts in the run's time but not in tokens/s
nor in the rate the ETA projects onto the steps left: a compiled run's first window would otherwise show a
fraction of its speed, and its ETA the compile time spread over every step to come. Evaluations and checkpoints
(side work) count in the windows they fall in, not in the result's tokens/s.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from kubetrain.track.console import Throughput


class RunClock:
    def __init__(self, start_step: int, tokens: int) -> None:
        self.start_step = start_step
        self.t_start = time.perf_counter()
        self.t_end: float | None = None
        self.side_seconds = 0.0  # evaluation and checkpoints
        self.first_step_seconds = 0.0
        self.meter = Throughput()
        self.meter.tokens0 = tokens

    def first_step_done(self, tokens: int, window_goes_on: bool) -> float:
        """The first step's seconds; the logging window that goes on after it starts its clock now."""
        self.first_step_seconds = time.perf_counter() - self.t_start
        if window_goes_on:
            self.meter.restart(tokens)
        return self.first_step_seconds

    @contextlib.contextmanager
    def side_work(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.side_seconds += time.perf_counter() - start

    def window(self, tokens: int) -> float:
        """Tokens/s since the previous window (or the first step's end)."""
        return self.meter.window(tokens)[0]

    def eta(self, step: int, max_steps: int) -> float | None:
        """Seconds left at the rate of the steps after the first (None before a step is done)."""
        done = step - self.start_step
        elapsed = time.perf_counter() - self.t_start
        if done > 1:
            elapsed, done = elapsed - self.first_step_seconds, done - 1
        return elapsed / done * (max_steps - step) if done else None

    def stop(self) -> None:
        self.t_end = time.perf_counter()

    def training_seconds(self) -> float:
        """Wall time from the start to the end of the loop, side work left out."""
        end = self.t_end if self.t_end is not None else time.perf_counter()
        return end - self.t_start - self.side_seconds

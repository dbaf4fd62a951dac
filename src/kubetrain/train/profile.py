"""`train.profile`: trace a few training steps with the PyTorch profiler, into the run directory.

The ranks asked for (rank 0 by default) each write two files into <run>/profile/ once the traced steps are done:
- trace-rank<R>-steps-<A>-<B>.json: the Chrome trace (open it in ui.perfetto.dev or chrome://tracing): every op on
  the host's threads and every kernel on the GPU's streams, on one time line;
- ops-rank<R>-steps-<A>-<B>.txt: the ops and kernels that took the most time, as the profiler's own table
  (`key_averages().table`), sorted by their own (self) time on the GPU (CUDA), or on the CPU.
How to read them: docs/performance.md. The other ranks do nothing, and neither does a run without `train.profile`.

torch's schedule: `wait` steps untraced, one `warmup` step (the profiler runs but keeps nothing: its own start-up
cost stays out of the numbers), then `active` traced steps; `on_trace_ready` writes the files.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from kubetrain.config.profile import ProfileConfig
from kubetrain.errors import UserInputError

PROFILE_DIR = "profile"
TOP_ROWS = 40


def sort_key(device_type: str) -> str:
    """The column the table is sorted by: an op's own time on the GPU on CUDA, on the CPU elsewhere."""
    return "self_device_time_total" if device_type == "cuda" else "self_cpu_time_total"


def window(start: int) -> tuple[int, int]:
    """(wait, warmup) before the traced steps that begin at `start` (1: this process's first step)."""
    warmup = 1 if start > 1 else 0
    return start - 1 - warmup, warmup


class StepProfiler:
    """Traces steps `start` .. `start + steps - 1` of this process (1 = its first step); `step` after each step."""

    def __init__(self, cfg: ProfileConfig, folder: Path, rank: int, device: torch.device, first_step: int,
                 log: Callable[[str], None] = print) -> None:
        self.cfg, self.folder, self.rank, self.device, self.log = cfg, folder, rank, device, log
        self.first = first_step + cfg.start  # the absolute step of the first traced one (the loop's step count)
        self.last = self.first + cfg.steps - 1
        self.done_step = first_step
        self.written: list[Path] = []
        self.unwritable: str | None = None  # why the files could not be written, when they could not
        wait, warmup = window(cfg.start)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.profiler: profile | None = profile(
            activities=activities, schedule=schedule(wait=wait, warmup=warmup, active=cfg.steps, repeat=1),
            on_trace_ready=self.write, record_shapes=True)
        self.profiler.start()
        log(f"profiling steps {self.first}-{self.last} on rank {rank} into {folder}")

    @classmethod
    def for_rank(cls, cfg: ProfileConfig | None, run_path: Path, rank: int, device: torch.device, first_step: int,
                 log: Callable[[str], None] = print, world_size: int = 1) -> StepProfiler | None:
        """A profiler for this rank when `train.profile` asks for it, else None (nothing runs, nothing is written).

        A rank the job does not have is bad input (every rank refuses it alike): it would trace nothing, silently."""
        if cfg is not None and (missing := sorted(r for r in set(cfg.ranks) if r >= world_size)):
            raise UserInputError(f"train.profile.ranks: no rank {', '.join(map(str, missing))} in a job of "
                                 f"{world_size} process{'es' if world_size > 1 else ''} (ranks 0-{world_size - 1})")
        if cfg is None or rank not in cfg.ranks:
            return None
        return cls(cfg, run_path / PROFILE_DIR, rank, device, first_step, log)

    def step(self, done_step: int) -> None:
        """After each training step (`done_step`: the loop's count): the profiler moves on; stops after the last."""
        if self.profiler is None:
            return
        self.done_step = done_step
        self.profiler.step()
        if done_step >= self.last:
            self.close()

    def close(self) -> None:
        """Stop: a window cut short by the end of the run is still written, with the steps it holds."""
        if self.profiler is not None:
            profiler, self.profiler = self.profiler, None
            profiler.stop()
            if self.unwritable:
                self.log(f"profile: warning: the trace of steps {self.first}-{self.last} was not written "
                         f"({self.unwritable}); training went on without it")
            elif not self.written:
                self.log(f"profile: the run stopped at step {self.done_step}, before step {self.first}; nothing "
                         "was traced (train.profile.start counts from where this process started)")

    def write(self, prof: profile) -> None:
        """on_trace_ready: the trace and the table of the traced steps. A folder that cannot be written (a file in
        its place, a full disk) is a warning: a trace is a diagnostic, never a reason to lose the run."""
        try:
            self._write(prof)
        except OSError as e:
            self.unwritable = f"{self.folder}: {e.strerror or e}"
            self.log(f"profile: warning: cannot write the trace into {self.unwritable}; the run goes on")

    def _write(self, prof: profile) -> None:
        last = min(self.done_step, self.last)
        name = f"rank{self.rank}-steps-{self.first}-{last}"
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = self.folder / f"trace-{name}.json"
        prof.export_chrome_trace(str(trace))
        ops = self.folder / f"ops-{name}.txt"
        key = sort_key(self.device.type)
        table = prof.key_averages().table(sort_by=key, row_limit=TOP_ROWS)
        ops.write_text(f"steps {self.first}-{last} of rank {self.rank} on {self.device}, sorted by {key} (the op's "
                       f"own time, without the ops it calls); totals over the {last - self.first + 1} step(s)\n\n"
                       f"{table}\n", encoding="utf-8")
        self.written += [trace, ops]
        self.log(f"profile of steps {self.first}-{last}: {trace} (open it in ui.perfetto.dev), top ops in {ops}")

"""Name the slow rank: each rank's time before the gradient collective, compared at log steps only.

What is timed is the data wait and the forward of every micro-batch: the backward ends in the all-reduce,
which makes every rank as slow as the slowest, so only the part before it tells ranks apart. The sums of a
logging window are gathered in one small all_gather at log steps (the log step's loss all-reduce is there
anyway); no collective is added per step. On CUDA the forward is timed with events, read at the log step
(the loss `.item()` synchronises there already), so no step gains a host sync.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as td
from torch import nn


def ratios(seconds: list[float]) -> list[float]:
    """Each rank's seconds over the median of the *other* ranks' (with 2 ranks: over the other one's).

    Not over the median of all: of two ranks that is their mean, so a rank 1.5x slower than the other read 1.2x,
    and no rank could ever read above 2x.
    """
    out = []
    for rank, mine in enumerate(seconds):
        others = statistics.median(seconds[:rank] + seconds[rank + 1:]) if len(seconds) > 1 else mine
        out.append(mine / others if others > 0 else 1.0)
    return out


@dataclass(frozen=True)
class Stragglers:
    seconds: list[float]  # per rank, rank order: data wait + forward over the logging window
    slowest_rank: int
    ratio: float  # the slowest rank's seconds over the median of the other ranks'
    ratios: list[float]  # every rank's, the same way

    @classmethod
    def of(cls, seconds: list[float]) -> Stragglers:
        slowest = max(range(len(seconds)), key=lambda r: seconds[r])
        each = ratios(seconds)
        return cls(seconds, slowest, each[slowest], each)

    def record(self) -> dict[str, object]:
        """The fields of a `train` line in metrics.jsonl."""
        return {"slowest_rank": self.slowest_rank, "straggler_ratio": round(self.ratio, 4),
                "rank_compute_seconds": [round(s, 6) for s in self.seconds],
                "rank_straggler_ratios": [round(r, 4) for r in self.ratios]}


class ComputeTimer:
    """Sums this rank's data wait + forward over a logging window.

    `start()` before the batch is read, `batch_ready()` once it is there, `stop()` when the loss is computed.
    The forward is timed from a pre-hook on the single-device model, so DDP's buffer broadcast at the start of
    its forward (a collective: the fast ranks wait there for the slow one) is not counted.
    """

    def __init__(self, device: torch.device, model: nn.Module) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.seconds = 0.0
        self._t0 = 0.0
        self._begin: torch.cuda.Event | None = None
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        model.register_forward_pre_hook(lambda module, args: self._forward_begins())

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def batch_ready(self) -> None:
        now = time.perf_counter()
        self.seconds += now - self._t0
        self._t0 = now  # the forward's start, unless the pre-hook sees a later one

    @torch.compiler.disable  # a clock read: under train.compile, Dynamo runs it as it is instead of warning
    def _forward_begins(self) -> None:
        if self.cuda:
            self._begin = torch.cuda.Event(enable_timing=True)
            self._begin.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self.cuda and self._begin is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._begin, end))
            self._begin = None
        else:
            self.seconds += time.perf_counter() - self._t0

    def window(self) -> float:
        """The window's seconds (resolving CUDA events), and a fresh window."""
        total = self.seconds + sum(b.elapsed_time(e) for b, e in self._events) / 1000.0
        self.seconds, self._events = 0.0, []
        return total

    def gather(self) -> Stragglers | None:
        """Every rank's window seconds (a collective: every rank calls it at the same log step); None alone."""
        mine = self.window()
        if not td.is_initialized() or td.get_world_size() == 1:
            return None
        everyone = [torch.zeros(1, dtype=torch.float64, device=self.device) for _ in range(td.get_world_size())]
        td.all_gather(everyone, torch.tensor([mine], dtype=torch.float64, device=self.device))
        return Stragglers.of([float(t) for t in everyone])

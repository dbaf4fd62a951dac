"""The pure choice of `micro_batch_size: auto`: numbers in, a micro-batch out; no config, no model, no collective.

A process's share of the global batch gives the candidates (the micro-batches that divide it, so accumulation is
whole); `choose` takes the largest whose need fits the budget. What a candidate needs is the caller's question
(train/micro_batch.py asks the memory estimate, with the candidate's own accumulation).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kubetrain.errors import UserInputError

GIB = 2**30
# Of the memory free at start, what `auto` plans to fill: the estimate is within about 10% of the measured peak
# (the estimate's stated accuracy; bench/results/memory_estimate_cpu_*.json on the CPU), and the allocator wants
# room of its own.
HEADROOM = 0.9


@dataclass(frozen=True)
class MicroBatchChoice:
    """What `auto` chose, and why: the candidates it looked at, the estimate of the choice and the budget."""

    micro_batch: int
    candidates: tuple[int, ...]  # largest first
    need: int  # bytes the estimate gives the choice (what the device must hold: `Estimate.device_need`)
    budget: int  # bytes it had to fit in
    fits: bool  # False: not even the smallest candidate fits (the memory check then refuses the run)
    budget_from: str = ""  # where the budget comes from, in words

    def describe(self) -> str:
        """Why: `the largest of 32, 16, 8 whose memory estimate (3.1 GiB) fits the budget (4.0 GiB: ...)`."""
        sizes = ", ".join(str(c) for c in self.candidates)
        if self.fits:
            return (f"the largest of {sizes} whose memory estimate ({size_text(self.need)}) fits the budget "
                    f"({size_text(self.budget)}: {self.budget_from})")
        return (f"the smallest of {sizes}, though its memory estimate ({size_text(self.need)}) exceeds the budget "
                f"({size_text(self.budget)}: {self.budget_from})")

    def to_json(self) -> dict[str, Any]:
        return {"micro_batch_size": self.micro_batch, "candidates": list(self.candidates), "need": self.need,
                "budget": self.budget, "fits": self.fits, "budget_from": self.budget_from}


def size_text(n: int) -> str:
    """Bytes in GiB, or MiB below a tenth of one (a tiny model is not "0.00 GiB")."""
    return f"{n / GIB:.1f} GiB" if n >= GIB / 10 else f"{n / 2**20:.1f} MiB"


def per_process_batch(global_batch: int, world_size: int) -> int:
    """Sequences per optimizer step of one process; a global batch the processes cannot share evenly is bad input."""
    if global_batch % world_size:
        raise UserInputError(f"train.global_batch_size {global_batch} is not a multiple of the {world_size} "
                             f"processes; use a multiple of {world_size}")
    return global_batch // world_size


def accum_steps(per_process: int, micro_batch: int, global_batch: int, world_size: int) -> int:
    """grad_accum_steps that keeps the global batch with this micro-batch; one that does not divide it is bad input."""
    if per_process % micro_batch:
        raise UserInputError(f"train.micro_batch_size {micro_batch} does not divide the {per_process} sequences per "
                             f"process of train.global_batch_size {global_batch} over {world_size} processes")
    return per_process // micro_batch


def candidates(per_process: int) -> list[int]:
    """The micro-batches `auto` may choose, largest first: those that divide one process's share of the global
    batch, so that grad accumulation keeps it exactly (a power of two steps down by halving)."""
    return [b for b in range(per_process, 0, -1) if per_process % b == 0]


def choose(sizes: Sequence[int], need: Callable[[int], int], budget: int, budget_from: str = ""
           ) -> MicroBatchChoice:
    """The largest of `sizes` whose `need` (bytes) is at most `budget`; the smallest, marked as not fitting, when
    none is. `need` grows with the micro-batch, so a binary search asks it a few times (an estimate builds the model
    on the meta device each time)."""
    ordered = tuple(sorted(set(sizes), reverse=True))
    if not ordered:
        raise ValueError("no micro-batch sizes to choose from")
    asked: dict[int, int] = {}

    def need_of(size: int) -> int:
        if size not in asked:
            asked[size] = need(size)
        return asked[size]

    ascending = ordered[::-1]
    lo, hi, best = 0, len(ascending) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if need_of(ascending[mid]) <= budget:
            best, lo = ascending[mid], mid + 1
        else:
            hi = mid - 1
    if best is None:
        return MicroBatchChoice(ascending[0], ordered, need_of(ascending[0]), budget, False, budget_from)
    return MicroBatchChoice(best, ordered, need_of(best), budget, True, budget_from)

"""The job's links before training, on a group of the job's backend made for the check: all-reduce bus bandwidth
and latency, send/recv between ring neighbours (one slow link is pinned to its two ranks), and the ranks' clocks.

Every rank runs the same collectives in the same order; where to stop growing a size is decided from values every
rank agrees on (an all-reduce MAX), so no rank waits in a collective the others skipped. Every function takes the
group (None: the default group); the preflight passes its own, which it destroys after the check, and with it the
communicators NCCL made for each send/recv pair.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as td

MiB = 2**20
SIZES = tuple(MiB * 4**k for k in range(5))  # 1, 4, 16, 64, 256 MiB
ITERATIONS = 5  # timed per size; the best counts (nccl-tests averages: here a descheduled rank is not a slow link)
LATENCY_ITERATIONS = 10
# A size whose bus bandwidth is under 1.15x the previous size's: the link is saturated, bigger sizes say nothing new.
SATURATED = 1.15


def bus_bandwidth(nbytes: int, seconds: float, world: int) -> float:
    """nccl-tests' bus bandwidth of an all-reduce in bytes/s: algbw x 2(n-1)/n, what each link carries, so it
    compares across world sizes (and with the hardware's link speed)."""
    return nbytes / seconds * 2 * (world - 1) / world


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


Group = td.ProcessGroup | None


def barrier(device: torch.device, group: Group = None) -> None:
    """A barrier on the group's device (NCCL otherwise guesses one, with a warning)."""
    td.barrier(group=group,
               device_ids=[device.index] if device.type == "cuda" and device.index is not None else None)


def _best_time(op: Callable[[], object], device: torch.device, iterations: int) -> float:
    best = math.inf
    for _ in range(iterations):
        started = time.perf_counter()
        op()
        _sync(device)
        best = min(best, time.perf_counter() - started)
    return best


def agreed_max(values: list[float], device: torch.device, group: Group = None) -> list[float]:
    """The largest of each value over all ranks: every rank then takes the same decision."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    td.all_reduce(tensor, op=td.ReduceOp.MAX, group=group)
    return [float(v) for v in tensor.cpu()]


def all_reduce_sweep(device: torch.device, world: int, seconds: float, group: Group = None) -> dict[str, Any]:
    """This rank's all-reduce latency (one float) and best time per size, growing 1 MiB x4 while the bus bandwidth
    still grows and the next size fits in `seconds` (the job's slowest rank decides both)."""
    started = time.perf_counter()
    tiny = torch.zeros(1, dtype=torch.float32, device=device)
    td.all_reduce(tiny, group=group)  # warm-up: connections, and NCCL's first kernel
    latency = _best_time(functools.partial(td.all_reduce, tiny, group=group), device, LATENCY_ITERATIONS)
    rows: list[dict[str, Any]] = []
    previous = 0.0
    for size in SIZES:
        buffer = torch.zeros(size // 4, dtype=torch.float32, device=device)
        td.all_reduce(buffer, group=group)
        _sync(device)
        best = _best_time(functools.partial(td.all_reduce, buffer, group=group), device, ITERATIONS)
        del buffer
        rows.append({"bytes": size, "seconds": best, "busbw": bus_bandwidth(size, best, world)})
        slowest, used = agreed_max([best, time.perf_counter() - started], device, group)
        job = bus_bandwidth(size, slowest, world)
        next_cost = slowest * 4 * (ITERATIONS + 1)
        if (previous and job < previous * SATURATED) or used + next_cost > seconds:
            break
        previous = job
    return {"latency_seconds": latency, "sizes": rows}


def all_reduce_busbw(device: torch.device, world: int, size: int, group: Group = None) -> float:
    """This rank's all-reduce bus bandwidth at one size (best of a few, after a warm-up)."""
    buffer = torch.zeros(size // 4, dtype=torch.float32, device=device)
    td.all_reduce(buffer, group=group)
    _sync(device)
    timed = _best_time(functools.partial(td.all_reduce, buffer, group=group), device, ITERATIONS)
    return bus_bandwidth(size, timed, world)


def neighbour_links(world: int) -> list[tuple[int, int]]:
    """The ring's links (r, r+1): each rank has two neighbours, so a slow rank shows on both of its links and a
    slow link on one."""
    if world < 2:
        return []
    if world == 2:
        return [(0, 1)]
    return [(r, (r + 1) % world) for r in range(world)]


def rounds(links: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """The links grouped so that no rank is in two links of one round (they are timed alone, not against each other)."""
    out: list[list[tuple[int, int]]] = []
    for link in links:
        for group in out:
            if not any(set(link) & set(other) for other in group):
                group.append(link)
                break
        else:
            out.append([link])
    return out


def link_sweep(device: torch.device, rank: int, world: int, size: int, group: Group = None) -> dict[int, float]:
    """This rank's bandwidth (bytes/s) to each ring neighbour: a ping-pong of `size` bytes each way, best of a few,
    one round of pairs at a time."""
    buffer = torch.zeros(size // 4, dtype=torch.float32, device=device)
    found: dict[int, float] = {}
    for pairs in rounds(neighbour_links(world)):
        barrier(device, group)
        for low, high in pairs:
            if rank not in (low, high):
                continue
            peer = high if rank == low else low

            def ping_pong(first_sends: bool = rank == low, peer: int = peer) -> None:
                if first_sends:
                    td.send(buffer, peer, group=group)
                    td.recv(buffer, peer, group=group)
                else:
                    td.recv(buffer, peer, group=group)
                    td.send(buffer, peer, group=group)

            ping_pong()  # warm-up: NCCL makes the pair's communicator here (in `group`: gone with it)
            _sync(device)
            found[peer] = 2 * size / _best_time(ping_pong, device, ITERATIONS)
    barrier(device, group)
    return found


def link_size(sweep_rows: list[dict[str, Any]], slowest_seconds: float, world: int, seconds: float) -> int:
    """The send/recv size: the all-reduce's last, made 4x smaller until the rounds fit in `seconds`. A ping-pong
    carries 2 x size per link where a ring all-reduce carries 2(n-1)/n x size, hence the world/(world-1)."""
    size = int(sweep_rows[-1]["bytes"])
    cost = slowest_seconds * world / max(1, world - 1) * len(rounds(neighbour_links(world))) * (ITERATIONS + 1)
    while size > SIZES[0] and cost > seconds:
        size //= 4
        cost /= 4
    return size


def clock_offsets(device: torch.device, world: int, readings: int = 3, group: Group = None) -> list[float]:
    """Seconds each rank's wall clock is ahead of rank 0's: the median of readings taken right after a barrier
    (its release reaches the ranks within a round trip, milliseconds, far below a skew that matters)."""
    taken: list[list[float]] = []
    for _ in range(readings):
        barrier(device, group)
        now = torch.tensor([time.time()], dtype=torch.float64, device=device)
        gathered = [torch.zeros_like(now) for _ in range(world)]
        td.all_gather(gathered, now, group=group)
        values = [float(g.item()) for g in gathered]
        taken.append([v - values[0] for v in values])
    return [statistics.median(column) for column in zip(*taken, strict=True)]

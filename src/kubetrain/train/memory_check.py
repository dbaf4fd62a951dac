"""Before a model is built: will training it fit in the memory free here? Refuse at once if it will not.

Without this a model too big for RAM is OOM-killed minutes later (exit 137, no message). The estimate is the one
`kubetrain doctor` and `k8s render` make (kubetrain.memory), for this run's layout: the strategy, the world size
and the processes on this node.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kubetrain.config.schema import Config
from kubetrain.errors import UserInputError
from kubetrain.memory import Estimate, Layout, estimate_on, what_to_change

GIB = 2**30


def check_memory(cfg: Config, layout: Layout | None = None, launcher: bool = False, free: int | None = None) -> None:
    """Raise UserInputError (one line: the estimate and what to change) when training `cfg` cannot fit here.

    `layout`: the run's processes (default: this worker's, from torchrun's WORLD_SIZE and LOCAL_WORLD_SIZE).
    `launcher`: the check of `--nproc`'s launcher, before its workers start, for CPU runs only (each GPU worker
    checks its own device; the launcher must not take a GPU context for the whole job): it asks for the node's
    processes together, with their runtime. A worker asks for what it has still to allocate, since its runtime is
    in place and its siblings may already hold theirs. `free`: the bytes free to check against (default: what the
    device has free now; the launcher's admission states a node's). Off with run.check_memory=false; silent when
    the size or the free memory is not known.
    """
    if not cfg.run.check_memory:
        return
    from kubetrain.hardware import device_info
    from kubetrain.train.device import select_device
    from kubetrain.train.micro_batch import resolve_batch

    if launcher:
        from kubetrain.distributed.setup import local_device

        if local_device(cfg.run.device).type != "cpu":  # no CUDA context: is_available() does not make one
            return
    if layout is None:
        from kubetrain.distributed.env import process_env

        penv = process_env()
        layout = Layout.of(cfg, penv.world_size, penv.local_world_size)
    device = select_device(cfg.run.device)
    budget = None  # auto plans on a share of the memory free, the stated figure's when given (as budget_for does)
    if free is not None and cfg.train.memory_budget_gib is None:
        from kubetrain.train.micro_batch_choice import HEADROOM

        budget = int(free * HEADROOM)
    cfg, _ = resolve_batch(cfg, layout, device, budget)  # auto: the largest that fits; none does: refused below
    est = estimate_on(cfg, layout, device)
    if free is None:
        free = device_info(device).memory_free
    if isinstance(est, str) or free is None:
        return
    need = est.device_need if launcher else est.to_allocate  # a worker already holds its runtime
    if need > free:
        raise UserInputError(refusal(est, need, free, together=launcher))


def refusal(est: Estimate, need: int, free: int, together: bool) -> str:
    """The one line that refuses a run: the estimate by part, the layout, what is free and what to change."""
    parts = ", ".join(f"{name} {size / GIB:.1f}" for name, size in est.parts.items())
    lay = est.layout
    each = ""
    if lay.world_size > 1:
        each = f" per process of {lay.world_size} ({lay.name}" + (f", sharded {lay.shards} ways)" if lay.shards > 1
                                                                  else ")")
        if together and need != est.per_process:
            each += f", x{lay.local_processes} processes on this node"
    return (f"this run needs about {need / GIB:.1f} GiB ({parts} GiB{each}; {est.params:,} parameters, "
            f"`kubetrain doctor CONFIG` shows the estimate) but {free / GIB:.1f} GiB is free on {est.device}; "
            f"{what_to_change(est.parts, lay)}, or set run.check_memory=false to start anyway")


ESTIMATE_TOLERANCE = 0.15  # after the first steps on a GPU, a measured peak further than this from the estimate warns


def peak_against_estimate(measured: int, estimated: int, tolerance: float = ESTIMATE_TOLERANCE) -> tuple[str, bool]:
    """The line that puts a measured peak beside the estimate, and whether they differ by more than `tolerance`
    (of the measured peak): then the estimate that decides what fits is wrong for this run, and the user should
    know before trusting `doctor` or `micro_batch_size: auto` with it."""
    ratio = estimated / measured if measured else float("inf")
    line = (f"memory: peak {measured / GIB:.2f} GiB measured, {estimated / GIB:.2f} GiB estimated "
            f"(estimate / measured {ratio:.2f})")
    return line, abs(estimated - measured) > tolerance * measured


def report_peak(cfg: Config, device: torch.device, out: Callable[[str], None]) -> None:
    """CUDA, after the first steps: the allocator's peak beside this worker's estimate (as check_memory makes it),
    and one warning when they differ by more than ESTIMATE_TOLERANCE. Nothing when the model's size is unknown."""
    from kubetrain.distributed.env import process_env

    penv = process_env()
    est = estimate_on(cfg, Layout.of(cfg, penv.world_size, penv.local_world_size), device)
    if isinstance(est, str):
        return
    # the allocator sees tensors only: not the CUDA context, not the host's runtime
    line, off = peak_against_estimate(torch.cuda.max_memory_allocated(device), est.to_allocate)
    out(line)
    if off:
        out(f"warning: the memory estimate is off by more than {ESTIMATE_TOLERANCE:.0%} for this run: `kubetrain "
            "doctor` and the memory check may misjudge what fits; please report it with this line")

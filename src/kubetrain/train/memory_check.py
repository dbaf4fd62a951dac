"""Before a model is built: will training it fit in the memory free here? Refuse at once if it will not.

Without this a model too big for RAM is OOM-killed minutes later (exit 137, no message). The estimate is the one
`kubetrain doctor` and `k8s render` make (kubetrain.memory), for this run's layout: the strategy, the world size
and the processes on this node.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kubetrain.config.schema import Config
from kubetrain.memory import Layout, estimate_on
from kubetrain.train.device import select_device

GIB = 2**30


def check_memory(cfg: Config, layout: Layout | None = None, launcher: bool = False, free: int | None = None) -> None:
    """Raise UserInputError (one line: the estimate and what to change) when training `cfg` cannot fit here.

    `layout`: the run's processes (default: this worker's, from torchrun's WORLD_SIZE and LOCAL_WORLD_SIZE).
    `launcher`: the check of `--nproc`'s launcher, before its workers start, for CPU runs only (each GPU worker
    checks its own device; the launcher must not take a GPU context for the whole job): it asks for the node's
    processes together, with their runtime. A worker asks for what it has still to allocate, since its runtime is
    in place and its siblings may already hold theirs. `free`: the bytes free to check against (default: what the
    device has free now). Off with run.check_memory=false; silent when the size or the free memory is not known.
    The verdict is the launch plan's (train/launch_plan.py), which `train` and the launcher make once and read.
    """
    if not cfg.run.check_memory:
        return
    from kubetrain.train.launch_plan import plan_on, plan_worker

    if layout is None:
        plan_worker(cfg, free=free).refuse_what_does_not_fit()
        return
    plan_on(cfg, layout, select_device(cfg.run.device), launcher=launcher, free=free).refuse_what_does_not_fit()


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

"""The launch plan: what a run of a config decides about this machine before anything is built, decided once.

Followed from `kubetrain train`, the plan is made in two places, each once:

- the `--nproc` launcher plans its node (`plan_launch`): the device its workers take, one GPU each; the processes
  (the node's, of the fewest nodes an elastic job may have); and for a CPU run, whose processes share the node's
  RAM, the micro-batch and the memory verdict of all of them together. A GPU run's launcher leaves both to its
  workers: it must not take a CUDA context for the whole job, and each worker judges its own GPU.
- each worker, or the one process, plans its run (`plan_worker`): its device, its place in the world, the
  micro-batch (`micro_batch_size: auto` chosen by the memory estimate, grad_accum_steps from the global batch), and
  the memory verdict for what it has still to allocate.

Every later step reads the plan: the launcher's admission (cores, then the verdict), the Trainer (its device, the
resolved config, the choice its first step confirms).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kubetrain.config.schema import Config
from kubetrain.distributed.parallelize import mesh_shape
from kubetrain.errors import UserInputError
from kubetrain.memory import Estimate, Layout, estimate_on, what_to_change
from kubetrain.train.device import DeviceFacts, check_process_count, choose_device
from kubetrain.train.micro_batch import resolve_batch
from kubetrain.train.micro_batch_choice import GIB, MicroBatchChoice


@dataclass(frozen=True)
class MemoryVerdict:
    """The memory check's answer: what the run needs here against what is free, and the line that refuses it."""

    need: int  # bytes: the node's processes together (a launcher), what a worker has still to allocate
    free: int  # bytes free on the device now (the host's RAM for a CPU run)
    refusal: str | None  # the one line that refuses the run (None: it fits)


@dataclass(frozen=True)
class LaunchPlan:
    """What a run decided before it starts; read top-down by the steps after it."""

    cfg: Config  # micro_batch_size and grad_accum_steps resolved (a GPU run's launcher leaves `auto` to its workers)
    device: torch.device
    layout: Layout  # the processes: strategy, world size, processes on this node, a launcher beside them
    micro_batch: MicroBatchChoice | None  # what `auto` chose (None: the config gave a number, or not planned here)
    # None: not judged (run.check_memory false, a GPU run's launcher, the model's size or the free memory unknown)
    memory: MemoryVerdict | None

    def refuse_what_does_not_fit(self) -> None:
        """Raise the verdict's one line (exit 2) when the run does not fit."""
        if self.memory is not None and self.memory.refusal is not None:
            raise UserInputError(self.memory.refusal)


def plan_worker(cfg: Config, world_size: int | None = None, local_world_size: int | None = None,
                facts: DeviceFacts | None = None, free: int | None = None) -> LaunchPlan:
    """The plan of this process: one of `world_size` processes, `local_world_size` of them on its node (default:
    what torchrun gave it, one process without it). `facts` and `free` state the machine (default: read here)."""
    if world_size is None or local_world_size is None:
        from kubetrain.distributed.env import process_env

        penv = process_env()
        world_size, local_world_size = penv.world_size, penv.local_world_size
    device = choose_device(cfg.run.device, facts or DeviceFacts.here())
    return plan_on(cfg, Layout.of(cfg, world_size, local_world_size), device, free=free)


def plan_launch(cfg: Config, nproc: int, min_nodes: int, fixed_nodes: int | None,
                facts: DeviceFacts | None = None, free: int | None = None) -> LaunchPlan:
    """The launcher's plan for `nproc` processes on each node: one GPU per process (or NCCL fails later), HSDP's
    shard group dividing the world (`fixed_nodes`: the node count when it is fixed), and for a CPU run the memory of
    the node's processes and the launcher together, of the fewest nodes (an elastic job's MIN leaves each process
    the most under FSDP)."""
    device = check_process_count(cfg.run.device, nproc, facts)
    if cfg.dist.strategy == "hsdp" and fixed_nodes is not None:
        mesh_shape("hsdp", fixed_nodes * nproc, nproc, cfg.dist.shard_size)
    return plan_on(cfg, Layout.of(cfg, nproc * min_nodes, nproc, launcher=True), device, launcher=True, free=free)


def plan_on(cfg: Config, layout: Layout, device: torch.device, launcher: bool = False,
            free: int | None = None) -> LaunchPlan:
    """The micro-batch and the memory verdict of `cfg` for a layout and device already decided. `launcher`: the
    check of the node's processes together, CPU runs only; a worker asks for what it has still to allocate, since
    its runtime is in place and its siblings may already hold theirs."""
    if launcher and (not cfg.run.check_memory or device.type != "cpu"):
        return LaunchPlan(cfg, device, layout, None, None)
    budget = None  # auto plans on a share of the memory free: the stated figure's when given (as budget_for does)
    if free is not None and cfg.train.memory_budget_gib is None:
        from kubetrain.train.micro_batch_choice import HEADROOM

        budget = int(free * HEADROOM)
    cfg, choice = resolve_batch(cfg, layout, device, budget)  # auto: the largest that fits; none does: refused
    verdict = memory_verdict(cfg, layout, device, launcher, free) if cfg.run.check_memory else None
    return LaunchPlan(cfg, device, layout, choice, verdict)


def memory_verdict(cfg: Config, layout: Layout, device: torch.device, launcher: bool,
                   free: int | None = None) -> MemoryVerdict | None:
    """The estimate for `layout` on `device` against the memory free there (`free`, default: read now); None when
    the model's size or the free memory is not known."""
    from kubetrain.hardware import device_info

    est = estimate_on(cfg, layout, device)
    if free is None:
        free = device_info(device).memory_free
    if isinstance(est, str) or free is None:
        return None
    need = est.device_need if launcher else est.to_allocate  # a worker already holds its runtime
    return MemoryVerdict(need, free, refusal(est, need, free, together=launcher) if need > free else None)


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

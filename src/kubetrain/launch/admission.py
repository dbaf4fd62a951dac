"""Before the `--nproc` launcher starts a worker: are there cores and memory for all of them? Refuse at once if not.

Seen without it: `kubetrain train --dry-run --nproc 1000` (a typo) started 1000 workers on a 24 GiB, 2-core
machine, each holding ~350 MiB before its first tensor; the machine was unusable for 40 minutes. Both checks run
in the launcher, before torch.distributed.run spawns anyone, and refuse in one line (exit 2).

The decision (`plan_refusal`) reads the launch plan and the node's figures (`Node`): the launcher reads this
machine's (`Node.here`), and a test states its own, so no test's verdict depends on the machine that runs it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kubetrain.config.schema import Config
from kubetrain.errors import UserInputError

if TYPE_CHECKING:
    from kubetrain.train.launch_plan import LaunchPlan

CPU_QUOTA = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "<quota> <period>" or "max <period>"


@dataclass(frozen=True)
class Node:
    """What a node offers the launcher's CPU workers: usable cores, and bytes of memory free (None: not known)."""

    cores: int
    memory_free: int | None

    @classmethod
    def here(cls) -> Node:
        """This machine's: usable cores (affinity, cgroup quota) and the RAM free (host, or the container's)."""
        import torch

        from kubetrain.hardware import device_info

        return cls(usable_cores(), device_info(torch.device("cpu")).memory_free)


def usable_cores(quota_file: Path = CPU_QUOTA) -> int:
    """The cores this process may run on: its CPU affinity, lowered by a cgroup CPU quota (a pod's CPU limit)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = quota_file.read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass  # no cgroup v2 quota here: the affinity is the limit
    return cores


def cores_problem(nproc: int, cores: int, oversubscribe: bool) -> str | None:
    """The line that refuses more CPU processes than cores (None when they fit, or `--oversubscribe` allows it)."""
    if nproc <= cores or oversubscribe:
        return None
    return (f"--nproc {nproc}: more CPU processes than the {cores} cores here; each would wait for a core and hold "
            f"its own memory (about 0.35 GiB before its first tensor); use --nproc {cores} or fewer, or pass "
            "--oversubscribe to start them anyway")


def check_cores(cfg: Config, nproc: int, oversubscribe: bool, cores: int | None = None) -> None:
    """Refuse (exit 2) a CPU run of more local processes than `cores` (default: this machine's usable cores); GPU
    runs are checked per GPU."""
    from kubetrain.train.device import select_device

    if select_device(cfg.run.device).type != "cpu":  # no CUDA context: is_available() does not make one
        return
    if problem := cores_problem(nproc, usable_cores() if cores is None else cores, oversubscribe):
        raise UserInputError(problem)


def plan_refusal(plan: LaunchPlan, oversubscribe: bool, cores: int) -> str | None:
    """Why a node of `cores` cannot take the plan's workers, in one line (cores first: it needs no estimate; then the
    plan's memory verdict, made against the node's free memory); None when it can. Only CPU runs are decided here:
    a GPU run's workers each judge their own GPU."""
    if plan.device.type != "cpu":
        return None
    nproc = plan.layout.local_processes
    if problem := cores_problem(nproc, cores, oversubscribe):
        return problem
    if plan.memory is not None and plan.memory.refusal is not None:  # the count first: what the user typed
        return f"--nproc {nproc}: {plan.memory.refusal}"
    return None


def refusal(cfg: Config, nproc: int, nnodes: str, oversubscribe: bool, node: Node) -> str | None:
    """The launcher's decision for `nproc` workers of `cfg` on `node`, planned as the launcher plans: its line, or
    None. A node whose free memory is not known is judged on its cores only."""
    from kubetrain.launch.elastic import parse_nnodes
    from kubetrain.train.launch_plan import plan_launch

    if node.memory_free is None:
        cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"check_memory": False})})
    plan = plan_launch(cfg, nproc, parse_nnodes(nnodes)[0], int(nnodes) if nnodes.isdigit() else None,
                       free=node.memory_free)
    return plan_refusal(plan, oversubscribe, node.cores)


def admit(plan: LaunchPlan, oversubscribe: bool = False, cores: int | None = None) -> None:
    """Refuse (exit 2) before anything is started when this node (`cores`, default: its usable cores) cannot take
    the plan's workers; the plan's memory verdict was made against this node's free memory when it was planned."""
    if problem := plan_refusal(plan, oversubscribe, usable_cores() if cores is None else cores):
        raise UserInputError(problem)

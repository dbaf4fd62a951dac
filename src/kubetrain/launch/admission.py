"""Before the `--nproc` launcher starts a worker: are there cores and memory for all of them? Refuse at once if not.

Seen without it: `kubetrain train --dry-run --nproc 1000` (a typo) started 1000 workers on a 24 GiB, 2-core
machine, each holding ~350 MiB before its first tensor; the machine was unusable for 40 minutes. Both checks run
in the launcher, before torch.distributed.run spawns anyone, and refuse in one line (exit 2).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

from kubetrain.config.schema import Config
from kubetrain.errors import UserInputError

if TYPE_CHECKING:
    from kubetrain.train.launch_plan import LaunchPlan

CPU_QUOTA = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "<quota> <period>" or "max <period>"


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


def check_cores(cfg: Config, nproc: int, oversubscribe: bool) -> None:
    """Refuse (exit 2) a CPU run of more local processes than usable cores; GPU runs are checked per GPU."""
    from kubetrain.train.device import select_device

    if select_device(cfg.run.device).type != "cpu":  # no CUDA context: is_available() does not make one
        return
    if problem := cores_problem(nproc, usable_cores(), oversubscribe):
        raise UserInputError(problem)


def admit(plan: LaunchPlan, oversubscribe: bool = False) -> None:
    """The launch plan's cores and memory, cores first (it needs no estimate): nothing is started when either
    refuses."""
    nproc = plan.layout.local_processes
    if plan.device.type == "cpu" and (problem := cores_problem(nproc, usable_cores(), oversubscribe)):
        raise UserInputError(problem)
    try:
        plan.refuse_what_does_not_fit()
    except UserInputError as e:  # the count comes first: it is what the user typed, and one thing to change
        raise UserInputError(f"--nproc {nproc}: {e}") from None

"""Before the `--nproc` launcher starts a worker: are there cores and memory for all of them? Refuse at once if not.

Seen without it: `kubetrain train --dry-run --nproc 1000` (a typo) started 1000 workers on a 24 GiB, 2-core
machine, each holding ~350 MiB before its first tensor; the machine was unusable for 40 minutes. Both checks run
in the launcher, before torch.distributed.run spawns anyone, and refuse in one line (exit 2).

The decision (`refusal`) takes the node's figures as arguments (`Node`): the launcher reads this machine's
(`Node.here`), and a test states its own, so no test's verdict depends on the machine that runs it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from kubetrain.config.schema import Config
from kubetrain.errors import UserInputError

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


def on_cpu(cfg: Config) -> bool:
    """Whether the run's workers are CPU processes (GPU runs are checked per GPU, by each worker)."""
    from kubetrain.distributed.setup import local_device

    return local_device(cfg.run.device).type == "cpu"  # no CUDA context: is_available() does not make one


def check_cores(cfg: Config, nproc: int, oversubscribe: bool, cores: int | None = None) -> None:
    """Refuse (exit 2) a CPU run of more local processes than `cores` (default: this machine's usable cores)."""
    if on_cpu(cfg) and (problem := cores_problem(nproc, usable_cores() if cores is None else cores, oversubscribe)):
        raise UserInputError(problem)


def memory_problem(cfg: Config, nproc: int, nnodes: str, memory_free: int | None) -> str | None:
    """The line that refuses `nproc` processes and the launcher on a node with `memory_free` bytes, of `nproc` x the
    fewest nodes (an elastic job's MIN leaves each process the most under FSDP); None when they fit, or when the
    free memory is not known."""
    from kubetrain.launch.elastic import parse_nnodes
    from kubetrain.memory import Layout
    from kubetrain.train.memory_check import check_memory

    if memory_free is None:
        return None
    try:
        check_memory(cfg, Layout.of(cfg, nproc * parse_nnodes(nnodes)[0], nproc, launcher=True), launcher=True,
                     free=memory_free)
    except UserInputError as e:  # the count comes first: it is what the user typed, and one thing to change
        return f"--nproc {nproc}: {e}"
    return None


def refusal(cfg: Config, nproc: int, nnodes: str, oversubscribe: bool, node: Node) -> str | None:
    """Why `node` cannot take the launcher's `nproc` workers, in one line (cores first: it needs no estimate); None
    when it can. Only CPU runs are decided here."""
    if not on_cpu(cfg):
        return None
    return cores_problem(nproc, node.cores, oversubscribe) or memory_problem(cfg, nproc, nnodes, node.memory_free)


def admit(cfg: Config, nproc: int, nnodes: str, oversubscribe: bool = False, node: Node | None = None) -> None:
    """Refuse (exit 2) before anything is started when `node` (default: this machine) cannot take the workers."""
    if problem := refusal(cfg, nproc, nnodes, oversubscribe, node or Node.here()):
        raise UserInputError(problem)

"""Rank, world size, local rank and master address from whatever launched this process.

Launchers we meet: torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT, TORCHELASTIC_*), Kubeflow
PyTorchJob (MASTER_ADDR, RANK, WORLD_SIZE, PET_*), Kubeflow Trainer v2 (PET_NNODES, PET_NODE_RANK,
PET_MASTER_ADDR/PORT), an Indexed Job (JOB_COMPLETION_INDEX), a StatefulSet (ordinal at the end of the
hostname) and JobSet (job-index annotation/label exposed through the downward API).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class ProcessEnv:
    """What this worker process is: its global rank among world_size, set by torchrun (or alone)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_MASTER_PORT
    elastic: bool = False  # started by torchrun's elastic agent
    restart_count: int = 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _int(env: Mapping[str, str], *names: str, default: int | None = None) -> int | None:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"environment variable {name}={value!r} is not an integer") from None
    return default


def process_env(env: Mapping[str, str] | None = None) -> ProcessEnv:
    """The worker's identity as torchrun (or a single process) presents it."""
    env = os.environ if env is None else env
    world = _int(env, "WORLD_SIZE", default=1) or 1
    return ProcessEnv(
        rank=_int(env, "RANK", default=0) or 0,
        world_size=world,
        local_rank=_int(env, "LOCAL_RANK", default=0) or 0,
        local_world_size=_int(env, "LOCAL_WORLD_SIZE", default=world) or world,
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_int(env, "MASTER_PORT", default=DEFAULT_MASTER_PORT) or DEFAULT_MASTER_PORT,
        elastic="TORCHELASTIC_RUN_ID" in env,
        restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", default=0) or 0,
    )


@dataclass(frozen=True)
class NodeEnv:
    """What this node (pod) is in a multi-node job, before torchrun starts its workers."""

    node_rank: int
    nnodes: int
    nproc_per_node: int
    master_addr: str
    master_port: int
    source: str  # which launcher's variables were read


_ORDINAL = re.compile(r"-(\d+)$")
JOBSET_INDEX_VARS = ("JOBSET_JOB_INDEX", "JOB_INDEX")  # set from jobset.sigs.k8s.io/job-index via downward API


def node_env(env: Mapping[str, str] | None = None, default_master: str = "127.0.0.1") -> NodeEnv:
    """Node rank, node count and rendezvous master from the workload's environment."""
    env = os.environ if env is None else env
    nnodes = _int(env, "PET_NNODES", "KUBETRAIN_NNODES", default=None)
    nproc = _int(env, "PET_NPROC_PER_NODE", "KUBETRAIN_NPROC_PER_NODE", default=1) or 1
    port = _int(env, "PET_MASTER_PORT", "MASTER_PORT", default=DEFAULT_MASTER_PORT) or DEFAULT_MASTER_PORT
    master = env.get("PET_MASTER_ADDR") or env.get("MASTER_ADDR") or env.get("KUBETRAIN_MASTER_ADDR") or default_master

    if "PET_NODE_RANK" in env:  # Kubeflow Trainer v2, and PyTorchJob's elastic variables
        source = "pytorchjob" if "PET_NPROC_PER_NODE" in env and "RANK" in env else "trainjob"
        rank = _int(env, "PET_NODE_RANK") or 0
    elif "MASTER_ADDR" in env and "RANK" in env and "WORLD_SIZE" in env and "PET_NNODES" not in env:
        # Kubeflow PyTorchJob v1 without PET_*: RANK and WORLD_SIZE count pods (nodes), not processes.
        source, rank = "pytorchjob", _int(env, "RANK") or 0
        nnodes = nnodes or _int(env, "WORLD_SIZE")
    elif any(v in env for v in JOBSET_INDEX_VARS):
        source = "jobset"
        job_index = _int(env, *JOBSET_INDEX_VARS) or 0
        pods_per_job = _int(env, "KUBETRAIN_PODS_PER_JOB", default=1) or 1
        rank = job_index * pods_per_job + (_int(env, "JOB_COMPLETION_INDEX", default=0) or 0)
    elif "JOB_COMPLETION_INDEX" in env:
        source, rank = "indexed-job", _int(env, "JOB_COMPLETION_INDEX") or 0
    elif "KUBETRAIN_STATEFULSET" in env:
        host = env.get("HOSTNAME", "")
        match = _ORDINAL.search(host)
        if not match:
            raise ValueError(f"cannot read a StatefulSet ordinal from hostname '{host}'")
        source, rank = "statefulset", int(match.group(1))
    else:
        source, rank = "single", 0
    nnodes = nnodes or 1
    if not 0 <= rank < nnodes:
        raise ValueError(f"node rank {rank} is outside 0..{nnodes - 1} (from {source} environment)")
    return NodeEnv(rank, nnodes, nproc, master, port, source)

"""Which node this pod is in a multi-node job, from whatever the workload's controller set.

Controllers we meet: Kubeflow PyTorchJob (MASTER_ADDR, RANK, WORLD_SIZE, PET_*), Kubeflow Trainer v2
(PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR/PORT), an Indexed Job (JOB_COMPLETION_INDEX), a StatefulSet
(ordinal at the end of the hostname) and JobSet (job-index annotation/label exposed through the downward API).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from kubetrain.distributed.env import DEFAULT_MASTER_PORT, env_int


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
    nnodes = env_int(env, "PET_NNODES", "KUBETRAIN_NNODES", default=None)
    nproc = env_int(env, "PET_NPROC_PER_NODE", "KUBETRAIN_NPROC_PER_NODE", default=1) or 1
    port = env_int(env, "PET_MASTER_PORT", "MASTER_PORT", default=DEFAULT_MASTER_PORT) or DEFAULT_MASTER_PORT
    master = env.get("PET_MASTER_ADDR") or env.get("MASTER_ADDR") or env.get("KUBETRAIN_MASTER_ADDR") or default_master

    if "PET_NODE_RANK" in env:  # Kubeflow Trainer v2, and PyTorchJob's elastic variables
        source = "pytorchjob" if "PET_NPROC_PER_NODE" in env and "RANK" in env else "trainjob"
        rank = env_int(env, "PET_NODE_RANK") or 0
    elif "MASTER_ADDR" in env and "RANK" in env and "WORLD_SIZE" in env and "PET_NNODES" not in env:
        # Kubeflow PyTorchJob v1 without PET_*: RANK and WORLD_SIZE count pods (nodes), not processes.
        source, rank = "pytorchjob", env_int(env, "RANK") or 0
        nnodes = nnodes or env_int(env, "WORLD_SIZE")
    elif any(v in env for v in JOBSET_INDEX_VARS):
        source = "jobset"
        job_index = env_int(env, *JOBSET_INDEX_VARS) or 0
        pods_per_job = env_int(env, "KUBETRAIN_PODS_PER_JOB", default=1) or 1
        rank = job_index * pods_per_job + (env_int(env, "JOB_COMPLETION_INDEX", default=0) or 0)
    elif "JOB_COMPLETION_INDEX" in env:
        source, rank = "indexed-job", env_int(env, "JOB_COMPLETION_INDEX") or 0
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

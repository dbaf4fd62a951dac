"""Rank, world size, local rank and master address of this process, from torchrun's variables
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT, TORCHELASTIC_*).

Which node a pod is in a multi-node job is the pod entrypoint's business: kubetrain.k8s.pod.node.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_MASTER_PORT = 29500
# Set in a pod that kubetrain rendered (the downward API, k8s/render/podspec.py): which pod and node this process
# is in, for lines that name a rank (the preflight's verdict). Outside Kubernetes the host name stands in.
POD_NAME_ENV = "KUBETRAIN_POD_NAME"
NODE_NAME_ENV = "KUBETRAIN_NODE_NAME"


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


def env_int(env: Mapping[str, str], *names: str, default: int | None = None) -> int | None:
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
    world = env_int(env, "WORLD_SIZE", default=1) or 1
    return ProcessEnv(
        rank=env_int(env, "RANK", default=0) or 0,
        world_size=world,
        local_rank=env_int(env, "LOCAL_RANK", default=0) or 0,
        local_world_size=env_int(env, "LOCAL_WORLD_SIZE", default=world) or world,
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=env_int(env, "MASTER_PORT", default=DEFAULT_MASTER_PORT) or DEFAULT_MASTER_PORT,
        elastic="TORCHELASTIC_RUN_ID" in env,
        restart_count=env_int(env, "TORCHELASTIC_RESTART_COUNT", default=0) or 0,
    )

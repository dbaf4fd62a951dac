"""What every pod runs: find this node's rank, wait for the rendezvous endpoint, start torchrun.

The node rank, node count and master come from whatever the workload's controller set (dist.env.node_env).
Node rank 0 hosts the c10d rendezvous store (`is_host` is passed explicitly, so it never depends on how a
hostname resolves), the others wait until its endpoint accepts TCP connections: a DNS record alone is not
enough, since a headless Service publishes a pod's name before the pod listens. The node rank decides
nothing else: c10d assigns global ranks by the order nodes join (torchrun ignores --node-rank with it).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from kubetrain.dist.env import NodeEnv, node_env
from kubetrain.errors import KubetrainError, UserInputError

Log = Callable[[str], None]
POD_IP_ENV = "KUBETRAIN_POD_IP"
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
SHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


class RendezvousUnreachable(KubetrainError):
    """Node rank 0's rendezvous endpoint did not answer in time."""


def read_node() -> NodeEnv:
    try:
        return node_env()
    except ValueError as e:
        raise UserInputError(f"cannot tell this pod's node rank: {e}") from None


def wait_for_endpoint(host: str, port: int, timeout: float, log: Log, interval: float = 2.0) -> None:
    """Block until host:port accepts a TCP connection (the name may not even resolve yet)."""
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(5.0, max(timeout, 0.1))):
                log(f"rendezvous endpoint {host}:{port} is up")
                return
        except OSError as e:
            reason = f"{type(e).__name__}: {e}"
            if reason != last:
                log(f"waiting for rendezvous endpoint {host}:{port} ({reason})")
                last = reason
        if time.monotonic() >= deadline:
            raise RendezvousUnreachable(
                f"rendezvous endpoint {host}:{port} did not accept connections within {timeout:g}s ({last})"
            )
        time.sleep(interval)


def torchrun_argv(node: NodeEnv, config: Path, *, rdzv_id: str, max_restarts: int,
                  local_addr: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The torch.distributed.run command line that trains `config` on this node."""
    argv = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(node.nnodes),
        "--nproc-per-node", str(node.nproc_per_node),
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"{node.master_addr}:{node.master_port}",
        "--rdzv-id", rdzv_id,
        "--rdzv-conf", f"is_host={'true' if node.node_rank == 0 else 'false'}",
        "--max-restarts", str(max_restarts),
    ]
    if local_addr:
        argv += ["--local-addr", local_addr]
    argv += ["-m", "kubetrain", "train", str(config), "--resume", "auto"]
    for item in overrides:
        argv += ["--set", item]
    return argv


def run(config: Path, *, rdzv_id: str, max_restarts: int, wait_timeout: float, shutdown_timeout: int,
        output_dir: str | None = None, idle_after_finish: bool = False, log: Log | None = None) -> int:
    """Check the config, wait for the rendezvous, then become torchrun (or supervise it, to idle after)."""
    from kubetrain.config import load_config

    say = log or (lambda m: print(f"[entrypoint] {m}", file=sys.stderr, flush=True))
    overrides = [f"run.output_dir={output_dir}"] if output_dir else []
    # Fail here with exit code 2 (the Job's podFailurePolicy fails at once); inside torchrun it would be
    # retried max_restarts times and surface as a generic worker failure.
    load_config(config, None, overrides)
    node = read_node()
    say(f"node {node.node_rank}/{node.nnodes} ({node.source}), {node.nproc_per_node} process(es) per node, "
        f"rendezvous {node.master_addr}:{node.master_port}")
    if node.node_rank != 0:
        wait_for_endpoint(node.master_addr, node.master_port, wait_timeout, say)
    argv = torchrun_argv(node, config, rdzv_id=rdzv_id, max_restarts=max_restarts,
                         local_addr=os.environ.get(POD_IP_ENV) or None, overrides=overrides)
    # How long torchrun lets its workers save a checkpoint after SIGTERM before it kills them (current torch
    # reads it; versions without the setting keep their 30 s).
    os.environ[SHUTDOWN_TIMEOUT_ENV] = str(shutdown_timeout)
    # With the store shared between agent and workers (torch's default), a replacement pod that joins a
    # later rendezvous round waits for a MASTER_ADDR key that rank 0 only wrote in its first round, and
    # both sides time out (pytorch/pytorch#135712). A store of the workers' own avoids it.
    os.environ.setdefault(SHARED_STORE_ENV, "1")
    say("starting " + " ".join(argv[1:]))
    if not idle_after_finish:
        # exec: torchrun becomes the container's main process and gets the kubelet's SIGTERM directly.
        os.execv(argv[0], argv)
    return supervise(argv, say)


def supervise(argv: list[str], say: Log) -> int:
    """Run torchrun as a child, forwarding SIGTERM/SIGINT; after success, idle until told to stop.

    For a StatefulSet, whose pods restart whatever exits: a finished run must not train again.
    """
    child = subprocess.Popen(argv)
    stop = {"requested": False}

    def forward(signum: int, frame: object) -> None:
        stop["requested"] = True
        if child.poll() is None:
            child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    code = child.wait()
    if code != 0 or stop["requested"]:
        return code
    say("training finished; idling so the StatefulSet does not restart it (kubetrain k8s stop removes it)")
    while not stop["requested"]:
        time.sleep(1)  # not signal.pause(): a SIGTERM just before it would be missed
    return 0

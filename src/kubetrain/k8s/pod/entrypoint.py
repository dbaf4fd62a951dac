"""What every pod runs: find this node's rank, wait for the rendezvous endpoint, run torch's elastic agent.

The node rank, node count and master come from whatever the workload's controller set (k8s.pod.node).
Node rank 0 hosts the c10d rendezvous store (`is_host` is passed explicitly, so it never depends on how a
hostname resolves), the others wait until its endpoint accepts TCP connections: a DNS record alone is not
enough, since a headless Service publishes a pod's name before the pod listens. The node rank decides
nothing else: c10d assigns global ranks by the order nodes join (torchrun ignores --node-rank with it).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kubetrain.errors import EXIT_PEER_LOST, KubetrainError, UserInputError
from kubetrain.k8s.pod.node import NodeEnv, node_env
from kubetrain.k8s.workloads import EXIT_CODE_POLICY_ENV, IDLE_MARKER, pod_exit_code
from kubetrain.launch.elastic import LaunchOptions, launch
from kubetrain.launch.watch import watch_options

Log = Callable[[str], None]
POD_IP_ENV = "KUBETRAIN_POD_IP"


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


def launch_options(node: NodeEnv, *, rdzv_id: str, max_restarts: int, shutdown_timeout: int,
                   local_addr: str | None = None) -> LaunchOptions:
    """How this node runs torch's elastic agent: c10d rendezvous on node rank 0's endpoint."""
    return LaunchOptions(
        nproc_per_node=node.nproc_per_node,
        nnodes=str(node.nnodes),
        rdzv_endpoint=f"{node.master_addr}:{node.master_port}",
        rdzv_id=rdzv_id,
        max_restarts=max_restarts,
        shutdown_timeout=shutdown_timeout,
        rdzv_conf=f"is_host={'true' if node.node_rank == 0 else 'false'}",
        local_addr=local_addr,
    )


def run(config: Path, *, rdzv_id: str, max_restarts: int, wait_timeout: float, shutdown_timeout: int,
        output_dir: str | None = None, idle_after_finish: bool = False, log: Log | None = None) -> int:
    """Check the config, wait for the rendezvous, then run the elastic agent here; the pod's exit code.

    The agent runs in this process (the container's main process), as `kubetrain train --nproc` does
    locally: a SIGTERM reaches the workers, which save a checkpoint, and the pod exits 75 (resumable), which
    the Job's podFailurePolicy tells apart from a crash (1) and bad input (2); a pod that lost its rendezvous
    host exits 69, which the policy ignores too.
    """
    from kubetrain import runs
    from kubetrain.config import load_config

    say = log or (lambda m: print(f"[entrypoint] {m}", file=sys.stderr, flush=True))
    overrides = [f"run.output_dir={output_dir}"] if output_dir else []
    # Fail here with exit code 2 (the Job's podFailurePolicy fails at once); inside the agent it would be
    # retried max_restarts times and surface as a generic worker failure.
    cfg = load_config(config, None, overrides)
    trace = os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")  # NCCL's flight recorder writes there, if it exists
    if trace:
        Path(trace).parent.mkdir(parents=True, exist_ok=True)
    node = read_node()
    say(f"node {node.node_rank}/{node.nnodes} ({node.source}), {node.nproc_per_node} process(es) per node, "
        f"rendezvous {node.master_addr}:{node.master_port}")
    if node.node_rank != 0:
        wait_for_endpoint(node.master_addr, node.master_port, wait_timeout, say)
    opts = launch_options(node, rdzv_id=rdzv_id, max_restarts=max_restarts, shutdown_timeout=shutdown_timeout,
                          local_addr=os.environ.get(POD_IP_ENV) or None)
    opts = dataclasses.replace(opts, **watch_options(cfg))
    train_args = [str(config), "--resume", "auto", *(a for item in overrides for a in ("--set", item))]
    say(f"starting the elastic agent: kubetrain train {' '.join(train_args)}")
    code = run_agent(opts, train_args, runs.run_dir(cfg), say)
    if code != 0 or not idle_after_finish:
        exit_code = pod_exit_code(code, os.environ.get(EXIT_CODE_POLICY_ENV))
        if exit_code != code:
            say(f"exiting {exit_code} (kubetrain's {code}): the operator replaces this pod instead of failing the job")
        return exit_code
    say(f"{IDLE_MARKER} so the StatefulSet does not restart it (kubetrain k8s stop removes it)")
    return idle_until_stopped()


def run_agent(opts: LaunchOptions, train_args: list[str], run_dir: Path, say: Log) -> int:
    """The elastic agent's exit code; EXIT_PEER_LOST when the rendezvous store on node rank 0 went away.

    The agent restarts its workers after a peer dies, and the next rendezvous then cannot reach the store node
    rank 0 hosted: torch raises RendezvousConnectionError (a traceback and exit 1 before). That pod did nothing
    wrong; its exit code is one the Job's podFailurePolicy ignores, so only the lost host counts as a failure.
    """
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousConnectionError

    try:
        return launch(opts, train_args, run_dir)
    except RendezvousConnectionError as e:
        cause = f": {e.__cause__}" if e.__cause__ else ""
        say(f"lost the rendezvous host {opts.rdzv_endpoint} (node rank 0 is gone{cause}); exiting "
            f"{EXIT_PEER_LOST} so this pod is replaced without counting as a failure")
        return EXIT_PEER_LOST
    except RendezvousClosedError:
        # Another node's agent gave up (no restarts left: its own failure is the one the Job counts) and closed the
        # rendezvous; this agent, restarting its workers, cannot join a new round: ~80 lines of traceback and exit 1
        # before. The replacement pods start a fresh rendezvous (node rank 0's pod hosts a new store).
        say(f"the rendezvous {opts.rdzv_id} at {opts.rdzv_endpoint} was closed by another node's agent (it gave "
            f"up); exiting {EXIT_PEER_LOST} so this pod is replaced without counting as a failure")
        return EXIT_PEER_LOST


def idle_until_stopped(ready: Callable[[], None] | None = None) -> int:
    """Sleep until SIGTERM/SIGINT, then exit 0: a StatefulSet's pod restarts whatever exits.

    `ready` runs once the signal handlers are in place (a stop asked for before then would kill the process).
    """
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    if ready is not None:
        ready()
    while not stop.wait(1.0):  # a short wait: the handler runs only between waits on some platforms
        pass
    return 0

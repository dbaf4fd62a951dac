"""The cluster's network on this one host: every pod on loopback, each port of a pod a free one of this machine."""

from __future__ import annotations

import socket
from typing import Any

from kubetrain.config.k8s import K8sConfig
from kubetrain.k8s.render.podspec import LAUNCHER_PORT_NAME, METRICS_PORT_NAME

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def free_port_pair(taken: set[int]) -> int:
    """A free port P with P + 1 free too (rank 0's exporter and its launcher's), neither in `taken`."""
    for _ in range(100):
        port = free_port()
        if port >= 65535 or {port, port + 1} & taken:
            continue
        with socket.socket() as s:
            try:
                s.bind((LOOPBACK, port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two adjacent free ports on this machine")


def pod_ports(k8s: K8sConfig, rdzv_port: int, container: dict[str, Any], taken: set[int]) -> dict[str | int, int]:
    """The container's ports on this host: the rendezvous port is the job's (`rdzv_port`); the metrics port and the
    launcher's (the next one) are the pod's own, since the pods share one network namespace here (also where
    the template declares none: a TrainJob's runtime owns its pod template)."""
    ports: dict[str | int, int] = {k8s.rdzv_port: rdzv_port}
    names = {int(p["containerPort"]): str(p["name"]) for p in container.get("ports", []) if p.get("name")}
    if k8s.metrics.enabled:
        base = free_port_pair(taken)
        taken.update({base, base + 1})
        ports.update({k8s.metrics.port: base, k8s.metrics.port + 1: base + 1})
        names.setdefault(k8s.metrics.port, METRICS_PORT_NAME)
        names.setdefault(k8s.metrics.port + 1, LAUNCHER_PORT_NAME)
    ports.update({name: ports[number] for number, name in names.items() if number in ports})
    return ports

"""The job's NetworkPolicy: who may reach its pods, and (with egress on) what its pods may reach.

Ingress: the job's own pods on every port (gloo and NCCL open connections between ranks on ephemeral ports),
and the metrics port from the monitoring namespace. Egress: the job's own pods, cluster DNS, the endpoints the
config names, and for a TrainJob the Trainer controller's status server (progress reports). A NetworkPolicy
selects pods, namespaces and address blocks, never host names: a service inside the cluster (`svc.ns`,
`svc.ns.svc.cluster.local`) becomes its namespace, an IP address its block, and a host outside the cluster
needs its addresses in k8s.network_policy.egress_cidrs.
"""

from __future__ import annotations

import ipaddress
from typing import Any
from urllib.parse import urlsplit

from kubetrain.checkpoint.store import S3_PROTOCOLS, is_remote, protocol_of
from kubetrain.k8s.render.context import RenderContext, RenderError
from kubetrain.k8s.render.podspec import LAUNCHER_PORT_NAME, METRICS_PORT_NAME

_DEFAULT_PORTS = {"http": 80, "https": 443, "postgresql": 5432, "postgres": 5432, "mysql": 3306}


def _endpoints(ctx: RenderContext) -> list[tuple[str, str]]:
    """(config key, URI) of every network endpoint the config names."""
    out = []
    tracking = ctx.cfg.track.mlflow.tracking_uri
    if ctx.cfg.track.mlflow.enabled and tracking and "://" in tracking and not tracking.startswith(("sqlite", "file")):
        out.append(("track.mlflow.tracking_uri", tracking))
    ckpt = ctx.cfg.checkpoint
    if ckpt.uri and ckpt.endpoint_url:
        out.append(("checkpoint.endpoint_url", ckpt.endpoint_url))
    elif ckpt.uri and is_remote(ckpt.uri) and not ctx.k.network_policy.egress_cidrs:
        service = "AWS S3" if protocol_of(ckpt.uri) in S3_PROTOCOLS else "a cloud object store"
        raise RenderError(
            f"k8s.network_policy.egress: checkpoint.uri {ckpt.uri} goes to {service}, whose addresses a "
            "NetworkPolicy cannot select by name; give them in k8s.network_policy.egress_cidrs (or set "
            "checkpoint.endpoint_url to a store inside the cluster)"
        )
    return out


def _peer(key: str, uri: str, ctx: RenderContext) -> dict[str, Any] | None:
    """The egress rule that lets pods reach one endpoint (None: egress_cidrs covers it)."""
    url = urlsplit(uri)
    host, scheme = url.hostname or "", url.scheme.split("+")[0]
    port = url.port or _DEFAULT_PORTS.get(scheme)
    ports = [{"port": port, "protocol": "TCP"}] if port else []
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    if address is not None:
        cidr = f"{address}/{32 if address.version == 4 else 128}"
        return {"to": [{"ipBlock": {"cidr": cidr}}], "ports": ports}
    parts = host.split(".")
    if len(parts) == 2 or (len(parts) >= 3 and parts[2] == "svc"):  # svc.ns, svc.ns.svc[.cluster.local]
        namespace = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": parts[1]}}}
        return {"to": [namespace], "ports": ports}
    if ctx.k.network_policy.egress_cidrs:
        return None
    raise RenderError(
        f"k8s.network_policy.egress: {key} names host '{host}', which a NetworkPolicy cannot select; give its "
        "addresses in k8s.network_policy.egress_cidrs"
    )


def network_policy(ctx: RenderContext) -> dict[str, Any]:
    policy = ctx.k.network_policy
    ingress: list[dict[str, Any]] = [{"from": [{"podSelector": {"matchLabels": ctx.selector}}]}]
    scrape = ctx.k.metrics.scrape_namespace
    if scrape and ctx.k.metrics.enabled:
        ingress.append(
            {
                "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": scrape}}}],
                "ports": [{"port": METRICS_PORT_NAME, "protocol": "TCP"},
                          {"port": LAUNCHER_PORT_NAME, "protocol": "TCP"}],
            }
        )
    spec: dict[str, Any] = {
        "podSelector": {"matchLabels": ctx.selector},
        "policyTypes": ["Ingress"],
        "ingress": ingress,
    }
    if policy.egress:
        dns = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": policy.dns_namespace}},
               "podSelector": {"matchLabels": dict(policy.dns_labels)}}
        egress: list[dict[str, Any]] = [
            {"to": [{"podSelector": {"matchLabels": ctx.selector}}]},
            {"to": [dns], "ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]},
        ]
        egress += [rule for key, uri in _endpoints(ctx) if (rule := _peer(key, uri, ctx)) is not None]
        status_server = ctx.cfg.track.kubeflow_trainer
        if ctx.workload == "trainjob" and status_server.enabled:  # progress to Kubeflow Trainer's controller
            controller = {"kubernetes.io/metadata.name": status_server.controller_namespace}
            egress.append({"to": [{"namespaceSelector": {"matchLabels": controller}}],
                           "ports": [{"port": status_server.controller_port, "protocol": "TCP"}]})
        if policy.egress_cidrs:
            egress.append({"to": [{"ipBlock": {"cidr": cidr}} for cidr in policy.egress_cidrs]})
        spec["policyTypes"] = ["Ingress", "Egress"]
        spec["egress"] = egress
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": ctx.meta(ctx.name),
            "spec": spec}

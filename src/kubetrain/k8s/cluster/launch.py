"""Put a rendered job on the cluster (server-side apply, idempotent) and take it off again (claims stay)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kubetrain.k8s.cluster.api import CUSTOM_KINDS, Cluster, ClusterError
from kubetrain.k8s.render.context import JOB_LABEL

Log = Callable[[str], None]
WORKLOAD_KINDS = ("Job", "JobSet", "PyTorchJob", "TrainJob", "StatefulSet")
# Deleted with the workload (by `stop`, and by the garbage collector once ttlSecondsAfterFinished removes it).
OWNED_KINDS = ("Service", "NetworkPolicy", "ConfigMap")


def _ref(obj: dict[str, Any]) -> str:
    return f"{obj['kind'].lower()}/{obj['metadata']['name']}"


def launch(
    cluster: Cluster, objects: list[dict[str, Any]], *, dry_run: bool = False, log: Log = print
) -> dict[str, Any]:
    """Apply every object in order; then make the workload the owner of its Service, ConfigMap and policy."""
    workload = objects[-1]
    if workload["kind"] in CUSTOM_KINDS:
        cluster.require(workload["kind"])
    suffix = " (dry run: validated by the API server, nothing stored)" if dry_run else ""
    for obj in objects[:-1]:
        _, created = cluster.apply(obj, dry_run=dry_run)
        log(f"{_ref(obj)} {'created' if created else 'applied'}{suffix}")
    try:
        stored, created = cluster.apply(workload, dry_run=dry_run)
    except ClusterError as e:
        if "immutable" in str(e):
            name = workload["metadata"]["name"]
            raise ClusterError(
                f"{e}\n{workload['kind']} '{name}' exists with a different spec, which cannot change: "
                f"`kubetrain k8s stop {name}` first (claims and checkpoints stay, the run resumes)"
            ) from None
        raise
    log(f"{_ref(workload)} {'created' if created else 'applied'}{suffix}")
    if dry_run:
        return stored
    owner = {
        "apiVersion": workload["apiVersion"],
        "kind": workload["kind"],
        "name": workload["metadata"]["name"],
        "uid": stored["metadata"]["uid"],
    }
    for obj in objects[:-1]:
        if obj["kind"] in OWNED_KINDS:
            owned = {**obj, "metadata": {**obj["metadata"], "ownerReferences": [owner]}}
            cluster.apply(owned)
    return stored


def stop(cluster: Cluster, name: str, namespace: str, log: Log = print) -> list[str]:
    """Delete the job's workload, Service, NetworkPolicy and ConfigMap; keep its claims (the checkpoints)."""
    selector = f"{JOB_LABEL}={name}"
    deleted = []
    for kind in (*WORKLOAD_KINDS, *OWNED_KINDS):
        if kind in CUSTOM_KINDS and not cluster.served(kind):
            continue
        for obj in cluster.list(kind, namespace, selector):
            if cluster.delete(kind, obj["metadata"]["name"], namespace):
                deleted.append(f"{kind.lower()}/{obj['metadata']['name']}")
                log(f"deleted {deleted[-1]}")
    if not deleted:
        raise ClusterError(f"no kubetrain job '{name}' in namespace {namespace} on {cluster.where}")
    kept = [c["metadata"]["name"] for c in cluster.list("PersistentVolumeClaim", namespace, selector)]
    if kept:
        log(f"kept claims (checkpoints; the next launch resumes from them): {', '.join(kept)}")
    return deleted

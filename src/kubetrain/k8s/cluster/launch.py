"""Put a rendered job on the cluster, all or nothing, and take it off again (the claims stay).

launch: the API server first validates every object in a dry run, so a relaunch it would refuse halfway
(a Job's pod template is immutable) changes nothing. Then claims, the workload, and the objects it owns
(ConfigMap, Service, NetworkPolicy) with their owner reference in their first apply: server-side apply
removes a field its manager leaves out, so the reference is never applied without, and the garbage
collector removes them with the workload. An unchanged running job is left as it is; a finished one is
refused with how to run again.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubetrain.errors import UserInputError
from kubetrain.k8s.cluster.api import Cluster
from kubetrain.k8s.cluster.api_errors import ClusterError, Forbidden, Invalid, NotFound
from kubetrain.k8s.render import validate
from kubetrain.k8s.workloads import (
    BY_KIND,
    OWNED_KINDS,
    SPEC_HASH,
    WORKLOAD_LABEL,
    WORKLOADS,
    finished,
    pod_selector,
)

Log = Callable[[str], None]


class JobExists(UserInputError):
    """The job exists in a state a launch cannot change."""


def _ref(obj: dict[str, Any]) -> str:
    return f"{obj['kind'].lower()}/{obj['metadata']['name']}"


def cr_schemas(cluster: Cluster, objects: list[dict[str, Any]], folder: Path | None) -> validate.Schemas | None:
    """Schemas of the custom resources: the CRDs this cluster serves, else --crds / $KUBETRAIN_CRD_DIR.

    A CRD the cluster does not have stops here with what to install.
    """
    kinds = sorted({o["kind"] for o in objects if not validate.is_core(o)})
    crds = [cluster.crd(kind) for kind in kinds]
    if kinds and all(crd is not None for crd in crds):
        return validate.schemas_of(crd for crd in crds if crd is not None)
    return validate.offline_schemas(folder)


def _owned(obj: dict[str, Any], owner: dict[str, Any] | None) -> dict[str, Any]:
    if owner is None or obj["kind"] not in OWNED_KINDS:
        return obj
    return {**obj, "metadata": {**obj["metadata"], "ownerReferences": [owner]}}


def _owner(stored: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": stored["apiVersion"], "kind": stored["kind"], "name": stored["metadata"]["name"],
            "uid": stored["metadata"]["uid"]}


def _check_relaunch(existing: dict[str, Any], workload: dict[str, Any]) -> bool:
    """Refuse a finished job; True when the running one is exactly what was rendered."""
    name = workload["metadata"]["name"]
    state = finished(existing)
    if state is not None:
        raise JobExists(
            f"{_ref(existing)} already finished ({state}); nothing was applied. To train again: "
            f"`kubetrain k8s stop {name}` (claims and checkpoints stay), then launch; or launch under another "
            "k8s.name"
        )
    ours = workload["metadata"].get("annotations", {}).get(SPEC_HASH)
    return ours is not None and (existing["metadata"].get("annotations") or {}).get(SPEC_HASH) == ours


def _apply(cluster: Cluster, obj: dict[str, Any], dry_run: bool) -> tuple[dict[str, Any], bool]:
    try:
        return cluster.apply(obj, dry_run=dry_run)
    except Invalid as e:
        immutable = [f for f, reason in e.causes if "immutable" in reason]
        if not immutable:
            raise
        name = obj["metadata"]["name"]
        raise JobExists(
            f"{_ref(obj)} is running with another spec, and its {', '.join(immutable)} cannot change (field is "
            f"immutable); nothing was changed. `kubetrain k8s stop {name}` first (claims and checkpoints stay, "
            "the run resumes), or launch under another k8s.name"
        ) from None


def launch(
    cluster: Cluster, objects: list[dict[str, Any]], *, dry_run: bool = False, log: Log = print
) -> bool:
    """Validate every object on the server, then apply them; False when nothing was (or needed to be) applied."""
    workload = objects[-1]
    if BY_KIND[workload["kind"]].custom:
        cluster.require(workload["kind"])
    name, namespace = workload["metadata"]["name"], workload["metadata"]["namespace"]
    existing = cluster.find(workload["kind"], name, namespace)
    if existing is not None and _check_relaunch(existing, workload):
        log(f"{_ref(workload)} is running and unchanged: nothing to apply")
        return False
    owner = _owner(existing) if existing is not None else None
    rest = [o for o in objects[:-1] if o["kind"] not in OWNED_KINDS]
    owned = [o for o in objects[:-1] if o["kind"] in OWNED_KINDS]
    for obj in (*rest, workload, *owned):
        _apply(cluster, _owned(obj, owner), dry_run=True)
    if dry_run:
        log(f"dry run: the API server accepted all {len(objects)} objects; nothing was stored")
        return False
    for obj in rest:
        log(f"{_ref(obj)} {'created' if _apply(cluster, obj, False)[1] else 'applied'}")
    stored, created = _apply(cluster, workload, False)
    log(f"{_ref(workload)} {'created' if created else 'applied'}")
    for obj in owned:
        log(f"{_ref(obj)} {'created' if _apply(cluster, _owned(obj, _owner(stored)), False)[1] else 'applied'}")
    return True


def _kinds_of(cluster: Cluster, name: str, namespace: str) -> list[str]:
    """The workload kind this job was launched as (recorded on its objects), else every kind there is."""
    config_map = cluster.find("ConfigMap", f"{name}-config", namespace)
    recorded = ((config_map or {}).get("metadata", {}).get("labels") or {}).get(WORKLOAD_LABEL)
    if recorded in WORKLOADS:
        return [WORKLOADS[recorded].kind]
    return [w.kind for w in WORKLOADS.values()]


def stop(cluster: Cluster, name: str, namespace: str, log: Log = print) -> list[str]:
    """Delete the job's workload, Service, NetworkPolicy and ConfigMap; keep its claims (the checkpoints).

    Kinds this user may not list (another operator's CRD without RBAC for the namespace editor) or that the
    cluster does not serve are skipped: the job was not launched as one of those.
    """
    selector = pod_selector(name)  # every object of the job carries the same label
    found: list[tuple[str, str]] = []
    skipped: list[str] = []  # said only when there is a job: a missing one is one line, the error
    for kind in (*_kinds_of(cluster, name, namespace), *OWNED_KINDS):
        try:
            found += [(kind, o["metadata"]["name"]) for o in cluster.list(kind, namespace, selector)]
        except (Forbidden, NotFound) as e:
            skipped.append(f"skipped {kind}: {'forbidden' if isinstance(e, Forbidden) else 'not served'} here")
    if not found:
        raise ClusterError(f"no kubetrain job '{name}' in namespace {namespace} on {cluster.where}")
    for line in skipped:
        log(line)
    for kind, obj in found:
        cluster.delete(kind, obj, namespace)  # gone already: the garbage collector took it with its owner
        log(f"deleted {kind.lower()}/{obj}")
    kept = [c["metadata"]["name"] for c in cluster.list("PersistentVolumeClaim", namespace, selector)]
    log(f"kept claims (checkpoints; the next launch resumes from them): {', '.join(kept)}" if kept
        else "no claims of this job to keep")
    return [f"{kind.lower()}/{obj}" for kind, obj in found]


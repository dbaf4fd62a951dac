"""Why a job, or one of its ranks, has no pod: what the cluster itself says, never a guess.

In order: the workload is gone or finished; Kueue keeps it queued (its Workload's conditions); it is suspended
(`spec.suspend`); its controller could not create the pod (a `FailedCreate` event on the workload, e.g. an
exceeded ResourceQuota); or its controller has not created it yet (a slow controller, or a pod being replaced).
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from kubetrain.k8s.cluster.api import Cluster
from kubetrain.k8s.cluster.api_errors import Forbidden
from kubetrain.k8s.render.context import CONFIG_FILE
from kubetrain.k8s.workloads import WORKLOAD_LABEL, WORKLOADS, conditions, finished

# pkg/controller/controller_utils.go: what a controller records on its object when creating a pod fails
FAILED_CREATE = "FailedCreate"
# kueue pkg/controller/constants: the queue label on a job, and the label on its Workload naming the job's uid
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"


def expected_ranks(config_map: dict[str, Any] | None) -> int | None:
    """k8s.nnodes of the config the job was launched with (its ConfigMap), or None without one."""
    if config_map is None:
        return None
    try:
        raw = yaml.safe_load((config_map.get("data") or {}).get(CONFIG_FILE, "")) or {}
        return int((raw.get("k8s") or {}).get("nnodes", 1))
    except (yaml.YAMLError, AttributeError, TypeError, ValueError):
        return None


def workload_object(cluster: Cluster, name: str, namespace: str,
                    config_map: dict[str, Any] | None) -> dict[str, Any] | None:
    """The launched workload object (Job, JobSet, ...), or None when it is gone or its kind is not served."""
    labels = ((config_map or {}).get("metadata") or {}).get("labels") or {}
    workload = WORKLOADS.get(labels.get(WORKLOAD_LABEL, "indexed-job"), WORKLOADS["indexed-job"])
    if workload.custom and not cluster.served(workload.kind):
        return None
    return cluster.find(workload.kind, name, namespace)


def failed_creates(cluster: Cluster, obj: dict[str, Any]) -> list[dict[str, Any]]:
    """The FailedCreate events recorded on this object, newest first ([] when events may not be read)."""
    meta = obj["metadata"]
    fields = f"involvedObject.kind={obj['kind']},involvedObject.name={meta['name']},reason={FAILED_CREATE}"
    try:
        events = cluster.list("Event", meta.get("namespace"), fields=fields)
    except Forbidden:
        return []
    uid = meta.get("uid")
    mine = [e for e in events if not uid or (e.get("involvedObject") or {}).get("uid") in (None, "", uid)]
    return sorted(mine, key=_event_time, reverse=True)


def _event_time(event: dict[str, Any]) -> str:
    return str(event.get("lastTimestamp") or event.get("eventTime")
               or (event.get("metadata") or {}).get("creationTimestamp") or "")


def _event_text(event: dict[str, Any]) -> str:
    count = int(event.get("count") or 1)
    return f"{FAILED_CREATE}: {event.get('message', '')}" + (f" ({count} times)" if count > 1 else "")


def rank_event(events: list[dict[str, Any]], job: str, rank: int | None,
               since: str = "") -> dict[str, Any] | None:
    """The newest event about this rank's pod, or about the job when none names a rank; only those newer than
    `since` (the creation of the rank's last pod: an older event was before that pod, and is stale).

    The pod is named by its generateName in the message: an Indexed Job's is `<job>-<index>-`.
    """
    fresh = [e for e in events if _event_time(e) >= since]
    if rank is None:
        return fresh[0] if fresh else None
    named = re.compile(rf'"{re.escape(job)}-(\d+)-')
    for event in fresh:
        found = named.search(str(event.get("message", "")))
        if found is None or int(found.group(1)) == rank:
            return event
    return None


def _suspended(obj: dict[str, Any]) -> bool:
    return bool((obj.get("spec") or {}).get("suspend")) or "Suspended" in conditions(obj)


def kueue_reason(cluster: Cluster, obj: dict[str, Any]) -> str | None:
    """Why Kueue holds this workload back, from its Workload's conditions; None when Kueue does not hold it.

    Kueue's webhook suspends a job with a queue label, and Kueue unsuspends it once its Workload (labelled
    with the job's uid) is admitted: QuotaReserved (a ClusterQueue's quota is set aside), then Admitted (the
    admission checks passed). A cluster without Kueue's CRDs is not asked for Workloads.
    """
    meta = obj["metadata"]
    queue = (meta.get("labels") or {}).get(QUEUE_LABEL)
    if not queue or not _suspended(obj) or not cluster.served("Workload"):
        return None
    where = f"queued by Kueue in LocalQueue {queue}"
    try:
        found = cluster.list("Workload", meta.get("namespace"), f"{JOB_UID_LABEL}={meta.get('uid')}")
    except Forbidden:
        return f"{where} (its Workload may not be read)"
    if not found:
        return f"{where}: Kueue has not made its Workload yet"
    by_type = {c.get("type"): c for c in (found[0].get("status") or {}).get("conditions") or []}

    def holds(kind: str) -> bool | None:
        condition = by_type.get(kind)
        return None if condition is None else condition.get("status") == "True"

    def said(kind: str) -> str:
        condition = by_type.get(kind) or {}
        return str(condition.get("message") or condition.get("reason") or "")

    if holds("Evicted"):
        return f"{where}: evicted: {said('Evicted')}"
    if holds("Admitted"):
        return f"{where}: admitted, the job starts"
    if holds("QuotaReserved"):
        return f"{where}: quota reserved, not admitted yet" + (f": {said('Admitted')}" if said("Admitted") else "")
    if holds("QuotaReserved") is False:
        return f"{where}: no quota reserved: {said('QuotaReserved')}"
    return f"{where}: not considered by Kueue yet"


class Waiting:
    """Why a job's ranks have no pod, asked of the cluster once for all of them (Kueue, then the events)."""

    def __init__(self, cluster: Cluster, obj: dict[str, Any] | None) -> None:
        self.obj = obj
        self.queued = None if obj is None or finished(obj) is not None else kueue_reason(cluster, obj)
        self.whole = self._whole()
        self.events = failed_creates(cluster, obj) if obj is not None and self.whole is None else []

    def _whole(self) -> str | None:
        """A reason that holds for every rank, or None when it depends on the rank."""
        if self.obj is None:
            return "the job is gone (deleted, or removed after ttlSecondsAfterFinished)"
        done = finished(self.obj)
        if done is not None:
            return f"the job has {done}"
        if self.queued is not None:
            return self.queued
        if _suspended(self.obj):
            return "the job is suspended (spec.suspend)"
        return None

    def why(self, rank: int | None = None, since: str = "") -> str:
        """One line: why this rank (or the job) has no pod right now; `since`: when the rank's last pod was made."""
        if self.whole is not None:
            return self.whole
        assert self.obj is not None
        event = rank_event(self.events, self.obj["metadata"]["name"], rank, since)
        if event is not None:
            return _event_text(event)
        return f"not created yet by the {self.obj['kind']} controller"


def why_waiting(cluster: Cluster, obj: dict[str, Any] | None, rank: int | None = None, since: str = "") -> str:
    """One line: why the job (or this rank) has no pod right now."""
    return Waiting(cluster, obj).why(rank, since)

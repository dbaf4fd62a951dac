"""What the test API server answers when a job waits for something outside it, each from the real system:

- a ResourceQuota refusing a pod (kube-apiserver's ResourceQuota admission) and the `FailedCreate` event
  the Job controller records on the Job then (client-go's event recorder, which aggregates repeats);
- field selectors on lists (events by `involvedObject.*`, `reason`);
- Kueue: the webhook that suspends a Job with a queue label and the Workload that stands for it;
- SelfSubjectAccessReview answered by the RBAC authorizer of a namespace editor.
"""

from __future__ import annotations

import hashlib
from typing import Any

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"  # kueue pkg/controller/constants: on the Job
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"  # kueue pkg/controller/constants: on the Workload, the Job's uid
WORKLOAD_API = "kueue.x-k8s.io/v1beta1"


# pkg/registry/core/event/strategy.go, ToSelectableFields: what an event list may be selected by
EVENT_FIELDS = {"metadata.name", "metadata.namespace", "involvedObject.kind", "involvedObject.namespace",
                "involvedObject.name", "involvedObject.uid", "involvedObject.apiVersion",
                "involvedObject.resourceVersion", "involvedObject.fieldPath", "reason", "reportingComponent",
                "source", "type"}


def unsupported_field(path: str, selector: str) -> str | None:
    """A field an event list cannot be selected by (kube-apiserver answers 400); other kinds are not checked."""
    if not path.endswith("/events"):
        return None
    for term in filter(None, selector.split(",")):
        key = term.split("!=", 1)[0].split("=", 1)[0]
        if key not in EVENT_FIELDS:
            return key
    return None


def field_value(obj: dict[str, Any], path: str) -> str:
    """A dotted field of an object as a field selector compares it (a missing field is "")."""
    value: Any = obj
    for key in path.split("."):
        value = value.get(key, "") if isinstance(value, dict) else ""
    return str(value)


def fields_match(selector: str, obj: dict[str, Any]) -> bool:
    """`a.b=x,c=y` (apimachinery pkg/fields): every term must hold; `!=` negates one."""
    for term in filter(None, selector.split(",")):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if field_value(obj, key) == value:
                return False
        else:
            key, _, value = term.partition("=")
            if field_value(obj, key.rstrip("=")) != value.lstrip("="):
                return False
    return True


def quota_refusal(objects: list[dict[str, Any]], namespace: str, generate_name: str) -> str | None:
    """The Forbidden message of the ResourceQuota admission plugin when one more pod exceeds a quota, else None.

    plugin/pkg/admission/resourcequota/controller.go: "exceeded quota: %s, requested: %s, used: %s, limited: %s";
    admission.NewForbidden names the pod by its generateName, since names are generated after admission.
    A pod counts against `pods` until it is terminal (pkg/quota/v1/evaluator/core/pods.go, QuotaV1Pod).
    """
    used = sum(1 for o in objects if o["kind"] == "Pod" and o["metadata"].get("namespace") == namespace
               and (o.get("status") or {}).get("phase") not in ("Succeeded", "Failed"))
    for quota in objects:
        if quota["kind"] != "ResourceQuota" or quota["metadata"].get("namespace") != namespace:
            continue
        hard = (quota.get("spec") or {}).get("hard") or {}
        limit = hard.get("pods", hard.get("count/pods"))
        if limit is not None and used + 1 > int(limit):
            return (f'pods "{generate_name}" is forbidden: exceeded quota: {quota["metadata"]["name"]}, '
                    f"requested: pods=1, used: pods={used}, limited: pods={limit}")
    return None


def record_event(events: list[dict[str, Any]], involved: dict[str, Any], reason: str, message: str,
                 component: str, now: str, serial: int) -> dict[str, Any] | None:
    """An Event about `involved`, or the count of an identical one raised (client-go tools/record/events_cache.go:
    the EventCorrelator aggregates events with the same source, object, type, reason and message)."""
    meta = involved["metadata"]
    ref = {"kind": involved["kind"], "namespace": meta.get("namespace"), "name": meta["name"],
           "uid": meta.get("uid"), "apiVersion": involved["apiVersion"]}
    for event in events:
        if event["involvedObject"] == ref and event["reason"] == reason and event["message"] == message:
            event["count"] += 1
            event["lastTimestamp"] = now
            return None
    return {"apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{serial:016x}", "namespace": meta.get("namespace"),
                         "creationTimestamp": now},
            "involvedObject": ref, "reason": reason, "message": message, "type": "Warning",
            "source": {"component": component}, "count": 1, "firstTimestamp": now, "lastTimestamp": now}


def kueue_workload(job: dict[str, Any]) -> dict[str, Any]:
    """The Workload Kueue's job reconciler creates for a Job (pkg/controller/jobframework/reconciler.go):
    named job-<name>-<hash> (GetWorkloadNameForOwnerWithGVK), labelled with the Job's uid, owned by the Job,
    one PodSet `main`; it waits for quota: QuotaReserved False, reason Pending, until the scheduler admits it."""
    meta = job["metadata"]
    digest = hashlib.sha256(f"{meta['name']}/{meta['uid']}".encode()).hexdigest()[:5]
    return {
        "apiVersion": WORKLOAD_API, "kind": "Workload",
        "metadata": {"name": f"job-{meta['name']}-{digest}", "namespace": meta["namespace"],
                     "labels": {JOB_UID_LABEL: meta["uid"]},
                     "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": meta["name"],
                                          "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}]},
        "spec": {"queueName": meta["labels"][QUEUE_LABEL], "active": True,
                 "podSets": [{"name": "main", "count": job["spec"]["parallelism"],
                              "template": job["spec"]["template"]}]},
        "status": {"conditions": []},
    }


def workload_condition(kind: str, status: bool, reason: str, message: str, now: str) -> dict[str, Any]:
    return {"type": kind, "status": "True" if status else "False", "reason": reason, "message": message,
            "lastTransitionTime": now}


def access_review(body: dict[str, Any], editor_of: str | None, forbidden: set[str]) -> dict[str, Any]:
    """A SelfSubjectAccessReview answered (authorization.k8s.io/v1; pkg/registry/authorization/
    selfsubjectaccessreview): status.allowed from the RBAC authorizer, which grants a namespace editor
    everything in its namespace but `forbidden` plurals, and has no opinion (allowed false, no reason) on the rest."""
    attributes = (body.get("spec") or {}).get("resourceAttributes") or {}
    if editor_of is None:
        allowed, reason = True, ""
    else:
        allowed = attributes.get("namespace") == editor_of and attributes.get("resource") not in forbidden
        reason = (f'RBAC: allowed by RoleBinding "edit/{editor_of}" of ClusterRole "edit" to User "alice"'
                  if allowed else "")
    status: dict[str, Any] = {"allowed": allowed}
    if reason:
        status["reason"] = reason
    return {**body, "metadata": {"creationTimestamp": None}, "status": status}

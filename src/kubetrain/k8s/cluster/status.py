"""What a launched job is doing: its state, each rank's pod (phase, node, restarts), the last step logged."""

from __future__ import annotations

import re
from typing import Any

from kubetrain.k8s.cluster.api import CUSTOM_KINDS, Cluster, ClusterError
from kubetrain.k8s.render.context import JOB_LABEL, MANAGED_BY, WORKLOAD_LABEL

KIND_OF_WORKLOAD = {
    "indexed-job": "Job",
    "jobset": "JobSet",
    "trainjob": "TrainJob",
    "pytorchjob": "PyTorchJob",
    "statefulset": "StatefulSet",
}
_STEP = re.compile(r"\bstep (\d+)/(\d+)\b")
_ORDINAL = re.compile(r"-(\d+)$")


def node_rank(pod: dict[str, Any]) -> int | None:
    """The node rank a pod's controller gave it, from the labels and annotations the controllers set."""
    meta = pod.get("metadata", {})
    labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
    replica_type = labels.get("training.kubeflow.org/replica-type")
    if replica_type is not None:  # PyTorchJob: master 0, worker i is node i + 1
        replica = int(labels.get("training.kubeflow.org/replica-index", 0))
        return 0 if replica_type.lower() == "master" else replica + 1
    index = annotations.get("batch.kubernetes.io/job-completion-index") or labels.get(
        "batch.kubernetes.io/job-completion-index"
    )
    if index is not None:  # Indexed Job, and the single replicated Job of a JobSet or TrainJob
        return int(index)
    if "apps.kubernetes.io/pod-index" in labels:
        return int(labels["apps.kubernetes.io/pod-index"])
    match = _ORDINAL.search(meta.get("name", ""))
    return int(match.group(1)) if match else None


def workload_state(obj: dict[str, Any] | None) -> str:
    if obj is None:
        return "gone (deleted, or removed after ttlSecondsAfterFinished)"
    status = obj.get("status") or {}
    if obj["kind"] == "StatefulSet":
        return f"{status.get('readyReplicas', 0)}/{obj['spec'].get('replicas', 0)} pods ready"
    true = [c["type"] for c in status.get("conditions") or [] if c.get("status") == "True"]
    for cond, state in (
        ("Failed", "failed"),
        ("Complete", "succeeded"),
        ("Completed", "succeeded"),
        ("Succeeded", "succeeded"),
        ("Suspended", "suspended"),
        ("Restarting", "restarting"),
        ("Running", "running"),
    ):
        if cond in true:
            return state
    if obj["kind"] == "Job":
        return "running" if status.get("active") else "pending"
    return "created"


def _restarts(pod: dict[str, Any]) -> int:
    return sum(
        int(c.get("restartCount", 0)) for c in (pod.get("status") or {}).get("containerStatuses") or []
    )


def main_container(pod: dict[str, Any]) -> str:
    annotations = pod["metadata"].get("annotations") or {}
    return str(
        annotations.get("kubectl.kubernetes.io/default-container") or pod["spec"]["containers"][0]["name"]
    )


def pods_by_rank(cluster: Cluster, name: str, namespace: str) -> list[tuple[int | None, dict[str, Any]]]:
    pods = cluster.list("Pod", namespace, f"{JOB_LABEL}={name}")
    ranked = [(node_rank(p), p) for p in pods]
    return sorted(ranked, key=lambda rp: (rp[0] is None, rp[0] or 0, rp[1]["metadata"]["name"]))


def last_step(
    cluster: Cluster, namespace: str, pods: list[tuple[int | None, dict[str, Any]]]
) -> tuple[int, int] | None:
    """(step, max_steps) from the newest progress line of the pod that logs progress (global rank 0)."""
    for _, pod in pods:
        if (pod.get("status") or {}).get("phase") not in ("Running", "Succeeded", "Failed"):
            continue
        found = None
        for line in cluster.log_lines(pod["metadata"]["name"], namespace, main_container(pod), tail=200):
            match = _STEP.search(line)
            if match:
                found = (int(match.group(1)), int(match.group(2)))
        if found:
            return found
    return None


def job_status(cluster: Cluster, name: str, namespace: str, with_step: bool = True) -> dict[str, Any]:
    config_map = cluster.find("ConfigMap", f"{name}-config", namespace)
    pods = pods_by_rank(cluster, name, namespace)
    if config_map is None and not pods:
        raise ClusterError(f"no kubetrain job '{name}' in namespace {namespace} on {cluster.where}")
    workload = ((config_map or {}).get("metadata", {}).get("labels") or {}).get(
        WORKLOAD_LABEL, "indexed-job"
    )
    kind = KIND_OF_WORKLOAD.get(workload, "Job")
    obj = None if kind in CUSTOM_KINDS and not cluster.served(kind) else cluster.find(kind, name, namespace)
    step = last_step(cluster, namespace, pods) if with_step else None
    return {
        "name": name,
        "namespace": namespace,
        "workload": workload,
        "state": workload_state(obj),
        "step": step[0] if step else None,
        "max_steps": step[1] if step else None,
        "pods": [
            {
                "rank": rank,
                "name": pod["metadata"]["name"],
                "phase": (pod.get("status") or {}).get("phase", "Unknown"),
                "node": pod["spec"].get("nodeName"),
                "restarts": _restarts(pod),
            }
            for rank, pod in pods
        ],
    }


def format_status(status: dict[str, Any]) -> str:
    step = f"step {status['step']}/{status['max_steps']}" if status["step"] is not None else "step unknown"
    lines = [
        f"{status['name']} ({status['workload']}, namespace {status['namespace']}): {status['state']}, {step}"
    ]
    for pod in status["pods"]:
        rank = "?" if pod["rank"] is None else pod["rank"]
        lines.append(
            f"  rank {rank}: {pod['name']} {pod['phase']} on {pod['node'] or '(not scheduled)'}, "
            f"{pod['restarts']} restarts"
        )
    if not status["pods"]:
        lines.append("  no pods")
    return "\n".join(lines)


def list_jobs(cluster: Cluster, namespace: str, all_namespaces: bool = False) -> list[dict[str, Any]]:
    """Every job kubetrain launched (found by the ConfigMap each one has)."""
    selector = f"app.kubernetes.io/managed-by={MANAGED_BY},{JOB_LABEL}"
    out = []
    for cm in cluster.list("ConfigMap", namespace, selector, all_namespaces=all_namespaces):
        labels = cm["metadata"].get("labels") or {}
        ns, name = cm["metadata"]["namespace"], labels[JOB_LABEL]
        kind = KIND_OF_WORKLOAD.get(labels.get(WORKLOAD_LABEL, ""), "Job")
        obj = None if kind in CUSTOM_KINDS and not cluster.served(kind) else cluster.find(kind, name, ns)
        out.append(
            {
                "name": name,
                "namespace": ns,
                "workload": labels.get(WORKLOAD_LABEL),
                "state": workload_state(obj),
                "created": cm["metadata"].get("creationTimestamp"),
            }
        )
    return out

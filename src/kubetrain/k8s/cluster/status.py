"""What a launched job is doing: its state, each rank's newest pod (phase, node, restarts, earlier failures),
and the last step the live pods logged."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kubetrain.k8s.cluster.api import Cluster, ClusterError
from kubetrain.k8s.cluster.waiting import Waiting, expected_ranks, workload_object
from kubetrain.k8s.workloads import (
    IDLE_MARKER,
    JOB_LABEL,
    MANAGED_BY,
    WORKLOAD_LABEL,
    conditions,
    finished,
    node_rank,
    pod_selector,
)

_STEP = re.compile(r"\bstep (\d+)/(\d+)\b")


@dataclass
class Rank:
    rank: int | None
    pod: dict[str, Any]  # the newest pod of this rank: the one that runs (or ran last)
    earlier_failed: int  # pods of this rank the controller replaced after they failed

    @property
    def phase(self) -> str:
        return str((self.pod.get("status") or {}).get("phase", "Unknown"))

    @property
    def name(self) -> str:
        return str(self.pod["metadata"]["name"])


def main_container(pod: dict[str, Any]) -> str:
    annotations = pod["metadata"].get("annotations") or {}
    return str(
        annotations.get("kubectl.kubernetes.io/default-container") or pod["spec"]["containers"][0]["name"]
    )


def ranks(pods: list[dict[str, Any]]) -> list[Rank]:
    """One entry per rank from its newest pod; a Job keeps the failed pods it replaced, which are counted."""
    by_rank: dict[int | None, list[dict[str, Any]]] = {}
    for pod in pods:
        by_rank.setdefault(node_rank(pod), []).append(pod)
    out = []
    for rank, group in by_rank.items():
        group.sort(key=lambda p: (p["metadata"].get("creationTimestamp") or "", p["metadata"]["name"]))
        failed = sum((p.get("status") or {}).get("phase") == "Failed" for p in group[:-1])
        out.append(Rank(rank, group[-1], failed))
    return sorted(out, key=lambda r: (r.rank is None, r.rank or 0, r.name))


def job_ranks(cluster: Cluster, name: str, namespace: str) -> list[Rank]:
    return ranks(cluster.list("Pod", namespace, pod_selector(name)))


def waiting_reason(pod: dict[str, Any]) -> str | None:
    """Why a pod does not run yet: the scheduler's verdict, or the container's waiting reason."""
    status = pod.get("status") or {}
    for condition in status.get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            return str(condition.get("message") or condition.get("reason") or "not scheduled")
    for container in status.get("containerStatuses") or []:
        waiting = (container.get("state") or {}).get("waiting")
        if waiting:
            return str(waiting.get("reason", "waiting")) + (f": {waiting['message']}" if waiting.get("message") else "")
    return None if pod.get("spec", {}).get("nodeName") else "not scheduled yet"


def _tail(cluster: Cluster, namespace: str, rank: Rank) -> list[str]:
    if rank.phase not in ("Running", "Succeeded", "Failed"):
        return []
    return list(cluster.log_lines(rank.name, namespace, main_container(rank.pod), tail=200))


def state(obj: dict[str, Any] | None, live: list[Rank], tails: dict[str, list[str]],
          missing: dict[int, str] | None = None, queued: str | None = None) -> str:
    """succeeded, failed, finished (a StatefulSet idling after training), queued by Kueue: why, suspended,
    pending: why, running.

    `missing`: the ranks of the config that have no pod, with why (waiting.why_waiting); `queued`: why Kueue
    holds the job (waiting.kueue_reason).
    """
    if obj is None:
        return "gone (deleted, or removed after ttlSecondsAfterFinished)"
    done = finished(obj)
    if done is not None:
        return done
    if queued:
        return queued
    if "Suspended" in conditions(obj) or (obj.get("spec") or {}).get("suspend"):
        return "suspended"
    if not live:
        reasons = dict.fromkeys((missing or {}).values())
        return "pending: no pods yet" + "".join(f": {why}" for why in reasons)
    if missing:
        return "pending: " + "; ".join(f"rank {rank} has no pod: {why}" for rank, why in sorted(missing.items()))
    if all(r.phase == "Pending" for r in live):  # a Job's status.active counts these too
        reasons = dict.fromkeys(waiting_reason(r.pod) or "pending" for r in live)
        return "pending: " + "; ".join(reasons)
    if obj["kind"] == "StatefulSet" and all(any(IDLE_MARKER in line for line in tails.get(r.name, []))
                                            for r in live):
        return "finished"
    return "running"


def last_step(live: list[Rank], tails: dict[str, list[str]]) -> tuple[int, int] | None:
    """(step, max_steps) from the newest progress line of the live pods (global rank 0 logs progress)."""
    for rank in live:
        steps = [m for line in tails.get(rank.name, []) for m in _STEP.finditer(line)]
        if steps:
            return int(steps[-1].group(1)), int(steps[-1].group(2))
    return None


def job_status(cluster: Cluster, name: str, namespace: str, with_step: bool = True) -> dict[str, Any]:
    config_map = cluster.find("ConfigMap", f"{name}-config", namespace)
    live = job_ranks(cluster, name, namespace)
    if config_map is None and not live:
        raise ClusterError(f"no kubetrain job '{name}' in namespace {namespace} on {cluster.where}")
    workload = ((config_map or {}).get("metadata", {}).get("labels") or {}).get(WORKLOAD_LABEL, "indexed-job")
    obj = workload_object(cluster, name, namespace, config_map)
    tails = {r.name: _tail(cluster, namespace, r) for r in live} if with_step else {}
    step = last_step(live, tails)
    have = {r.rank for r in live}
    wanted = [n for n in range(expected_ranks(config_map) or 0) if n not in have]
    held = wanted or not live or (obj or {}).get("spec", {}).get("suspend")  # suspended: Kueue may hold it
    waiting = Waiting(cluster, obj) if obj is not None and finished(obj) is None and held else None
    missing = {n: waiting.why(n) for n in wanted} if waiting is not None else {}
    return {
        "name": name,
        "namespace": namespace,
        "workload": workload,
        "state": state(obj, live, tails, missing, waiting.queued if waiting is not None else None),
        "step": step[0] if step else None,
        "max_steps": step[1] if step else None,
        "pods": [
            {
                "rank": r.rank,
                "name": r.name,
                "phase": r.phase,
                "node": r.pod["spec"].get("nodeName"),
                "restarts": sum(int(c.get("restartCount", 0))
                                for c in (r.pod.get("status") or {}).get("containerStatuses") or []),
                "earlier_failed": r.earlier_failed,
                "waiting": waiting_reason(r.pod) if r.phase == "Pending" else None,
            }
            for r in live
        ],
        "missing": [{"rank": rank, "reason": why} for rank, why in sorted(missing.items())],
    }


def format_status(status: dict[str, Any]) -> str:
    step = f"step {status['step']}/{status['max_steps']}" if status["step"] is not None else "step unknown"
    lines = [
        f"{status['name']} ({status['workload']}, namespace {status['namespace']}): {status['state']}, {step}"
    ]
    for pod in status["pods"]:
        rank = "?" if pod["rank"] is None else pod["rank"]
        line = (f"  rank {rank}: {pod['name']} {pod['phase']} on {pod['node'] or '(not scheduled)'}, "
                f"{pod['restarts']} restarts")
        if pod["earlier_failed"]:
            line += f", {pod['earlier_failed']} earlier failed pod{'s' if pod['earlier_failed'] > 1 else ''}"
        if pod.get("waiting"):  # a Pending rank: the scheduler's verdict, or why its container waits
            line += f": {pod['waiting']}"
        lines.append(line)
    for missing in status.get("missing") or []:
        lines.append(f"  rank {missing['rank']}: no pod: {missing['reason']}")
    if not status["pods"] and not status.get("missing"):
        lines.append("  no pods")
    return "\n".join(lines)


def list_jobs(cluster: Cluster, namespace: str, all_namespaces: bool = False) -> list[dict[str, Any]]:
    """Every job kubetrain launched (found by the ConfigMap each one has), with its state."""
    selector = f"app.kubernetes.io/managed-by={MANAGED_BY},{JOB_LABEL}"
    out = []
    for cm in cluster.list("ConfigMap", namespace, selector, all_namespaces=all_namespaces):
        labels = cm["metadata"].get("labels") or {}
        ns, name = cm["metadata"]["namespace"], labels[JOB_LABEL]
        status = job_status(cluster, name, ns, with_step=labels.get(WORKLOAD_LABEL) == "statefulset")
        out.append({"name": name, "namespace": ns, "workload": labels.get(WORKLOAD_LABEL),
                    "state": status["state"], "created": cm["metadata"].get("creationTimestamp")})
    return out

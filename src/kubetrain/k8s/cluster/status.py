"""What a launched job is doing: its state, each rank's newest pod (phase, node, restarts, earlier failures),
its progress (step, %, tokens/s, ETA, slowest rank) and its last incident, read from the pods' logs.

The run folder is on a claim this command cannot read, so the logs are the channel: rank 0's console line
(track.console) and the launcher's `incident: ...` line (runs.incidents), found in the last TAIL_LINES lines of
each live pod's log, of its previous container (a restart) and of the pod it replaced.
"""

from __future__ import annotations

import datetime
import math
import re
import time
from dataclasses import dataclass
from typing import Any

import yaml

from kubetrain.k8s.cluster.api import Cluster
from kubetrain.k8s.cluster.api_errors import ClusterError
from kubetrain.k8s.cluster.failures import last_failure, oom_advice, oom_incident
from kubetrain.k8s.cluster.preflight_lines import preflight_from_logs, preflight_text
from kubetrain.k8s.cluster.waiting import Waiting, expected_ranks, workload_object
from kubetrain.k8s.render.context import CONFIG_FILE
from kubetrain.k8s.render.indexed_job import pod_failure_policy
from kubetrain.k8s.workloads import (
    IDLE_MARKER,
    JOB_LABEL,
    MANAGED_BY,
    WORKLOAD_LABEL,
    conditions,
    finished,
    main_container,
    node_rank,
    pod_selector,
)
from kubetrain.runs.incidents import log_line, parse_log_line
from kubetrain.track.console import duration, parse_progress

TAIL_LINES = 1000  # of each log read: enough for an incident an hour old at one progress line every few seconds
# A running job with no new progress line for this long (or three of its own gaps between lines, if longer) is
# not moving: `k8s status` drops the ETA and says how long. A checkpoint or an eval fits well inside it.
STALLED_AFTER_MIN = 120.0
_RESUMED = re.compile(r"resuming from \S+ \(step (\d+)")  # train/checkpointing.py, rank 0's line on a resume


@dataclass
class Rank:
    rank: int | None
    pod: dict[str, Any]  # the newest pod of this rank: the one that runs (or ran last)
    earlier_failed: int  # pods of this rank the controller replaced after failures it counts (podFailurePolicy)
    replaced: dict[str, Any] | None = None  # the pod this one replaced (its log may hold the incident that ended it)

    @property
    def phase(self) -> str:
        return str((self.pod.get("status") or {}).get("phase", "Unknown"))

    @property
    def name(self) -> str:
        return str(self.pod["metadata"]["name"])


def ranks(pods: list[dict[str, Any]]) -> list[Rank]:
    """One entry per rank from its newest pod; a Job keeps the failed pods it replaced: those its
    podFailurePolicy counts are counted (a pod that stopped resumable, 75, or lost its rendezvous host, 69, is not)."""
    by_rank: dict[int | None, list[dict[str, Any]]] = {}
    for pod in pods:
        by_rank.setdefault(node_rank(pod), []).append(pod)
    out = []
    for rank, group in by_rank.items():
        group.sort(key=lambda p: (p["metadata"].get("creationTimestamp") or "", p["metadata"]["name"]))
        failed = sum(counted_failure(p) for p in group[:-1])
        out.append(Rank(rank, group[-1], failed, group[-2] if len(group) > 1 else None))
    return sorted(out, key=lambda r: (r.rank is None, r.rank or 0, r.name))


def counted_failure(pod: dict[str, Any]) -> bool:
    """A failed pod the Job controller counts against backoffLimit under the podFailurePolicy kubetrain renders
    (render/indexed_job.py): its first matching rule decides, and `Ignore` is not counted; no rule matching: counted.

    Matched as the controller does (batch/v1 PodFailurePolicyRule): onPodConditions by type and status;
    onExitCodes on `state.terminated.exitCode` of the named container (every container when unnamed), where
    containers that exited 0 are left out.
    """
    status = pod.get("status") or {}
    if status.get("phase") != "Failed":
        return False
    for rule in pod_failure_policy(main_container(pod))["rules"]:
        if _matches(rule, status):
            return bool(rule["action"] != "Ignore")
    return True


def _matches(rule: dict[str, Any], status: dict[str, Any]) -> bool:
    if "onPodConditions" in rule:
        have = {(c.get("type"), c.get("status")) for c in status.get("conditions") or []}
        return any((want["type"], want.get("status", "True")) in have for want in rule["onPodConditions"])
    exits = rule.get("onExitCodes")
    if not exits:
        return False
    containers = [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]
    codes = [int(c["state"]["terminated"]["exitCode"]) for c in containers
             if (c.get("state") or {}).get("terminated") and exits.get("containerName") in (None, c.get("name"))]
    codes = [code for code in codes if code != 0]
    if exits["operator"] == "In":
        return any(code in exits["values"] for code in codes)
    return exits["operator"] == "NotIn" and any(code not in exits["values"] for code in codes)


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


def _tail(cluster: Cluster, namespace: str, pod: dict[str, Any], previous: bool = False,
          stamps: list[float] | None = None) -> list[str]:
    """The pod's last lines; with `stamps`, the kubelet's time of each line (seconds) is appended there."""
    if (pod.get("status") or {}).get("phase") not in ("Running", "Succeeded", "Failed"):
        return []
    lines = []
    for line in cluster.log_lines(pod["metadata"]["name"], namespace, main_container(pod), tail=TAIL_LINES,
                                  previous=previous, timestamps=stamps is not None):
        if stamps is not None:
            stamp, _, rest = line.partition(" ")
            at = log_time(stamp)
            stamps.append(at[0] + at[1] / 1e9 if at else math.nan)
            line = rest if at else line  # a line without the kubelet's stamp is kept whole
        lines.append(line)
    return lines


_STAMP = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?(Z|[+-]\d\d:\d\d)")


def log_time(stamp: str) -> tuple[int, int] | None:
    """(seconds since the epoch, nanoseconds) of the kubelet's RFC 3339 stamp (Go's RFC3339Nano: trailing zeros
    of the fraction dropped, the node's offset kept); None for anything else."""
    match = _STAMP.fullmatch(stamp)
    if match is None:
        return None
    whole, fraction, offset = match.groups()
    when = datetime.datetime.fromisoformat(whole + ("+00:00" if offset == "Z" else offset))
    return int(when.timestamp()), int((fraction or "").ljust(9, "0"))


def restarted(pod: dict[str, Any]) -> bool:
    """The main container ran before (`lastState.terminated`): the kubelet still has that instance's log."""
    name = main_container(pod)
    return any(c.get("name") == name and (c.get("lastState") or {}).get("terminated")
               for c in (pod.get("status") or {}).get("containerStatuses") or [])


def earlier_logs(cluster: Cluster, namespace: str, live: list[Rank]) -> dict[str, list[str]]:
    """The tails of each rank's previous container and of the pod it replaced: where the incident that ended
    them was printed. A log that is gone (node removed, rotated) is skipped: it is history, not state."""
    out: dict[str, list[str]] = {}
    for rank in live:
        sources = [(f"{rank.name}, previous container", rank.pod, True)] if restarted(rank.pod) else []
        if rank.replaced is not None:
            sources.append((f"{rank.replaced['metadata']['name']}, replaced", rank.replaced, False))
        for label, pod, previous in sources:
            try:
                out[label] = _tail(cluster, namespace, pod, previous)
            except ClusterError:
                continue
    return out


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


def last_progress(live: list[Rank], tails: dict[str, list[str]],
                  stamps: dict[str, list[float]] | None = None) -> dict[str, Any] | None:
    """The newest progress line of the live pods, parsed (global rank 0 logs progress, on whichever pod it runs),
    with `logged_at`: when the kubelet took it (from `stamps`, None without).

    A progress line older than an incident or a resume in the same log is from before the workers were ended: its
    rate and ETA are not the run's now. After a resume the step is the resumed one, until the next progress line.
    """
    for rank in live:
        resumed: int | None = None
        ended = False
        lines = tails.get(rank.name, [])
        times = (stamps or {}).get(rank.name) or []
        for i in range(len(lines) - 1, -1, -1):
            line = lines[i]
            progress = parse_progress(line)
            if progress is not None:
                at = times[i] if i < len(times) and math.isfinite(times[i]) else None
                progress = {**progress, "logged_at": at}
                if resumed is None and not ended:
                    return progress
                step = progress["step"] if resumed is None else resumed
                return {**progress, "step": step, "tokens_per_second": None, "eta_seconds": None,
                        "slowest_rank": None, "straggler_ratio": None}
            found = _RESUMED.search(line)
            if found is not None and resumed is None and not ended:
                resumed = int(found.group(1))
            ended = ended or parse_log_line(line) is not None
    return None


def last_incident(logs: dict[str, list[str]]) -> dict[str, Any] | None:
    """The newest `incident: ...` line of these logs (by the time it carries: each node's launcher prints its own),
    with the log it came from."""
    newest: dict[str, Any] | None = None
    for source, lines in logs.items():
        for line in lines:
            entry = parse_log_line(line)
            if entry is not None and (newest is None or entry["time"] >= newest["time"]):
                newest = {**entry, "log": source}
    return newest


def progress_fields(progress: dict[str, Any] | None, state: str, log_every: int = 1,
                    now: float | None = None) -> dict[str, Any]:
    """step, max_steps, percent, tokens_per_second, eta_seconds (only while running and moving), slowest rank,
    whether training is finished (the job succeeded or finished, or the last step is logged): then there is no
    ETA; and how long ago the last step was logged. A running job whose last progress line is older than
    `stalled_after` says so and has no ETA: a rank that stopped leaves the last line as if all were well."""
    p = progress or dict.fromkeys(("step", "max_steps", "tokens_per_second", "eta_seconds", "slowest_rank",
                                   "straggler_ratio"))
    done = state in ("succeeded", "finished") or (p["step"] is not None and p["step"] >= p["max_steps"])
    logged_at = p.get("logged_at")
    ago = None if logged_at is None else max(0.0, (time.time() if now is None else now) - logged_at)
    stalled = state == "running" and not done and ago is not None and ago > stalled_after(p, log_every)
    return {
        "seconds_since_step": None if ago is None else round(ago),
        "stalled": stalled,
        "step": p["step"],
        "max_steps": p["max_steps"],
        "percent": round(100 * p["step"] / p["max_steps"], 1) if p["step"] is not None and p["max_steps"] else None,
        "tokens_per_second": p["tokens_per_second"],
        "eta_seconds": p["eta_seconds"] if state == "running" and not done and not stalled else None,
        "training_finished": done,
        "slowest_rank": p["slowest_rank"],
        "straggler_ratio": p["straggler_ratio"],
    }


def stalled_after(progress: dict[str, Any], log_every: int) -> float:
    """Seconds without a new progress line after which a running job is not moving: three times the gap the run's
    own pace gives between two lines (its ETA over the steps left, times train.log_every_steps), at least
    STALLED_AFTER_MIN (a checkpoint or an eval between two lines is no stall)."""
    left = (progress.get("max_steps") or 0) - (progress.get("step") or 0)
    eta = progress.get("eta_seconds")
    gap = eta / left * log_every if eta is not None and left > 0 else 0.0
    return max(STALLED_AFTER_MIN, 3 * gap)


def log_every_steps(config_map: dict[str, Any] | None) -> int:
    """train.log_every_steps of the config the job was launched with (1 where it cannot be read)."""
    try:
        raw = yaml.safe_load(((config_map or {}).get("data") or {}).get(CONFIG_FILE, "")) or {}
        return max(1, int((raw.get("train") or {}).get("log_every_steps", 10)))
    except (yaml.YAMLError, AttributeError, TypeError, ValueError):
        return 1


def job_status(cluster: Cluster, name: str, namespace: str, with_step: bool = True,
               with_incident: bool = True) -> dict[str, Any]:
    """The job's state, pods and (with_step) its progress read from the live pods' logs; with_incident also reads
    the logs of restarted containers and replaced pods for the last incident."""
    config_map = cluster.find("ConfigMap", f"{name}-config", namespace)
    pods = cluster.list("Pod", namespace, pod_selector(name))
    live = ranks(pods)
    if config_map is None and not live:
        raise ClusterError(f"no kubetrain job '{name}' in namespace {namespace} on {cluster.where}")
    workload = ((config_map or {}).get("metadata", {}).get("labels") or {}).get(WORKLOAD_LABEL, "indexed-job")
    obj = workload_object(cluster, name, namespace, config_map)
    stamps: dict[str, list[float]] = {r.name: [] for r in live}
    tails = {r.name: _tail(cluster, namespace, r.pod, stamps=stamps[r.name]) for r in live} if with_step else {}
    earlier = earlier_logs(cluster, namespace, live) if with_step and with_incident else {}
    have = {r.rank for r in live}
    wanted = [n for n in range(expected_ranks(config_map) or 0) if n not in have]
    held = wanted or not live or (obj or {}).get("spec", {}).get("suspend")  # suspended: Kueue may hold it
    waiting = Waiting(cluster, obj) if obj is not None and finished(obj) is None and held else None
    missing = {n: waiting.why(n) for n in wanted} if waiting is not None else {}
    now = state(obj, live, tails, missing, waiting.queued if waiting is not None else None)
    failure = failure_of(pods, config_map)
    return {
        "name": name,
        "namespace": namespace,
        "workload": workload,
        "state": now,
        **progress_fields(last_progress(live, tails, stamps), now, log_every_steps(config_map)),
        "last_incident": newest(last_incident({**earlier, **tails}), oom_incident(failure)),
        "last_failure": failure,
        "preflight": preflight_from_logs({**earlier, **tails}),  # the job's check before step 1
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


def failure_of(pods: list[dict[str, Any]], config_map: dict[str, Any] | None) -> dict[str, Any] | None:
    """The newest failure of the job's pods (failures.py), an OOM kill with the advice doctor would give."""
    failure = last_failure(pods)
    if failure is not None and failure["reason"] == "OOMKilled":
        failure = last_failure(pods, oom_advice(config_map))
    return failure


def newest(*incidents: dict[str, Any] | None) -> dict[str, Any] | None:
    return max((i for i in incidents if i is not None), key=lambda i: i["time"], default=None)


def progress_text(status: dict[str, Any]) -> str:
    """`step 120/200 (60%), 12,345 tok/s, eta 1:02:03`; `training finished` in place of the ETA once it is."""
    if status["step"] is None:
        return "step unknown"
    parts = [f"step {status['step']}/{status['max_steps']}"
             + (f" ({status['percent']:g}%)" if status.get("percent") is not None else "")]
    if status.get("tokens_per_second") is not None:
        parts.append(f"{status['tokens_per_second']:,.0f} tok/s")
    if status.get("training_finished"):
        parts.append("training finished")
    elif status.get("stalled"):
        parts.append(f"no new step for {duration(status['seconds_since_step'])}")
    elif status.get("eta_seconds") is not None:
        parts.append(f"eta {duration(status['eta_seconds'])}")
    return ", ".join(parts)


def format_status(status: dict[str, Any]) -> str:
    lines = [f"{status['name']} ({status['workload']}, namespace {status['namespace']}): {status['state']}, "
             f"{progress_text(status)}"]
    if status.get("slowest_rank") is not None:
        lines.append(f"  slowest rank: {status['slowest_rank']} ({status['straggler_ratio']:g}x the median rank)")
    incident = status.get("last_incident")
    if incident:
        lines.append(f"  last incident: {log_line(incident).removeprefix('incident: ')} [{incident['log']}]")
    failure = status.get("last_failure")
    if failure:
        lines.append(f"  last failure: {failure['message']}")
    if status.get("preflight"):
        lines.append(f"  {preflight_text(status['preflight'])}")
    for pod in status["pods"]:
        rank = "?" if pod["rank"] is None else pod["rank"]
        line = (f"  pod {rank}: {pod['name']} {pod['phase']} on {pod['node'] or '(not scheduled)'}, "
                f"{pod['restarts']} restarts")
        if pod["earlier_failed"]:
            line += f", {pod['earlier_failed']} earlier failed pod{'s' if pod['earlier_failed'] > 1 else ''}"
        if pod.get("waiting"):  # a Pending rank: the scheduler's verdict, or why its container waits
            line += f": {pod['waiting']}"
        lines.append(line)
    for missing in status.get("missing") or []:
        lines.append(f"  pod {missing['rank']}: not there: {missing['reason']}")
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
        # a StatefulSet's state needs its logs (the idle marker); nobody's needs the earlier ones
        status = job_status(cluster, name, ns, with_step=labels.get(WORKLOAD_LABEL) == "statefulset",
                            with_incident=False)
        out.append({"name": name, "namespace": ns, "workload": labels.get(WORKLOAD_LABEL),
                    "state": status["state"], "created": cm["metadata"].get("creationTimestamp")})
    return out

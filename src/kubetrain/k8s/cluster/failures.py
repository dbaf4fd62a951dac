"""Why a rank's pod failed, in words, from what the kubelet wrote in its status: OOMKilled, evicted, an image that
cannot be pulled, exited N. `k8s status` and the last line of `logs -f` name it, so a failed job says why.

Where the kubelet writes each (kubernetes/kubernetes):
- OOMKilled: the container runtime reports the cgroup's OOM kill as the container's exit reason; the kubelet copies
  it into `state.terminated.reason` (or `lastState`, after a restart in place) with exit code 137
  (pkg/kubelet/kuberuntime/kuberuntime_container.go, toKubeContainerStatus; CRI's ContainerStatus.reason).
- Evicted: the eviction manager fails the pod with `status.reason: Evicted` and a message naming the resource
  (pkg/kubelet/eviction/eviction_manager.go, evictPod; helpers.go evictionMessage), and adds the
  `DisruptionTarget` condition (reason TerminationByKubelet) that the Job's podFailurePolicy ignores.
- An image that cannot be pulled: the container waits with reason ErrImagePull, then ImagePullBackOff
  (pkg/kubelet/images/image_manager.go); the pod stays Pending, so the Job never fails by itself.
"""

from __future__ import annotations

import datetime
from typing import Any

from kubetrain.errors import EXIT_PEER_LOST, EXIT_STOPPED_RESUMABLE
from kubetrain.k8s.workloads import kubetrain_exit_code, main_container, node_rank

IMAGE_PULL = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull")


def _main(pod: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the main container's spec, its status) of a pod (the first container, or kubectl's default one)."""
    name = main_container(pod)
    spec: dict[str, Any] = next((c for c in pod["spec"].get("containers") or [] if c.get("name") == name), {})
    status: dict[str, Any] = next((c for c in (pod.get("status") or {}).get("containerStatuses") or []
                                   if c.get("name") == name), {})
    return spec, status


def pod_failure(pod: dict[str, Any], advice: str = "") -> dict[str, Any] | None:
    """The failure of one pod: `rank`, `pod`, `reason` (OOMKilled, Evicted, ErrImagePull..., Error), `exit_code`,
    `message` (one line) and `time` (when, seconds since the epoch); None when it did not fail.

    `advice`: what to change after an OOM kill (the memory estimate, doctor's words), appended to its message."""
    status = pod.get("status") or {}
    spec, container = _main(pod)
    name, rank = pod["metadata"]["name"], node_rank(pod)
    who = f"rank {'?' if rank is None else rank}: container {spec.get('name', '?')} of pod {name}"
    if status.get("reason") == "Evicted":
        message = str(status.get("message") or "evicted").strip()
        return {"rank": rank, "pod": name, "reason": "Evicted", "exit_code": None, "time": _when(pod, None),
                "message": f"{who} was evicted from node {pod['spec'].get('nodeName') or '?'}: {message}"}
    waiting = (container.get("state") or {}).get("waiting") or {}
    if waiting.get("reason") in IMAGE_PULL:
        text = f": {waiting['message']}" if waiting.get("message") else ""
        return {"rank": rank, "pod": name, "reason": waiting["reason"], "exit_code": None, "time": _when(pod, None),
                "message": f"{who} cannot pull image {spec.get('image', '?')} ({waiting['reason']}{text})"}
    ended = (container.get("state") or {}).get("terminated") or (container.get("lastState") or {}).get("terminated")
    if not ended or ended.get("exitCode") is None or kubetrain_exit_code(ended["exitCode"]) in (
            0, EXIT_STOPPED_RESUMABLE, EXIT_PEER_LOST):
        return None  # 75 and 69 are no failures: stopped after a checkpoint, lost the rendezvous host
    code, reason = int(ended["exitCode"]), str(ended.get("reason") or "Error")
    if reason == "OOMKilled":
        limit = ((spec.get("resources") or {}).get("limits") or {}).get("memory")
        at = f" at its memory limit of {limit}" if limit else " (no memory limit: the node ran out)"
        message = f"{who} was OOMKilled (exit {code}){at}" + (f": {advice}" if advice else "")
    else:
        message = f"{who} exited {code}" + (f" ({reason})" if reason not in ("Error", "") else "")
    return {"rank": rank, "pod": name, "reason": reason, "exit_code": code, "time": _when(pod, ended),
            "message": message}


CAUSE_WINDOW = 60.0  # seconds: the ranks that fail within this of the newest failure fell with it


def last_failure(pods: list[dict[str, Any]], advice: str = "") -> dict[str, Any] | None:
    """The cause of the newest failure among these pods (every pod of the job, replaced ones included).

    One rank's failure takes the others down within seconds (they lose their peer: exit 1, or 69), so of the
    failures within CAUSE_WINDOW of the newest the first is the cause, and in the same second (finishedAt has whole
    seconds) the kernel's or the kubelet's verdict (OOMKilled, Evicted) comes before an exit code."""
    found = [f for f in (pod_failure(p, advice) for p in pods) if f is not None]
    if not found:
        return None
    newest = max(f["time"] for f in found)
    return min((f for f in found if f["time"] >= newest - CAUSE_WINDOW),
               key=lambda f: (f["time"], f["reason"] not in ("OOMKilled", "Evicted")))


def oom_incident(failure: dict[str, Any] | None) -> dict[str, Any] | None:
    """An OOM kill as the incident `k8s status` shows: the pod's launcher died with it (the container's cgroup is
    killed as a group), so no `incident: oom` line exists; the kubelet's status is the record."""
    if failure is None or failure["reason"] != "OOMKilled":
        return None
    return {"kind": "oom", "rank": failure["rank"], "step": None, "time": failure["time"],
            "message": failure["message"], "stacks": None, "log": f"{failure['pod']}, containerStatuses"}


def oom_advice(config_map: dict[str, Any] | None) -> str:
    """What to change after an OOM kill, for the config the job was launched with (its ConfigMap): the estimate
    render and `kubetrain doctor` make, and what shrinks it; a plain word when the config cannot be read."""
    plain = "raise k8s.resources.memory (`kubetrain doctor CONFIG` shows the estimate)"
    try:
        import yaml

        from kubetrain.config.loading import validate
        from kubetrain.k8s.render.context import CONFIG_FILE
        from kubetrain.k8s.render.memory import host_need, pod_advice, size
        from kubetrain.memory import model_shape

        raw = yaml.safe_load(((config_map or {}).get("data") or {}).get(CONFIG_FILE, "")) or {}
        cfg = validate(raw, "the job's ConfigMap")
        shape = model_shape(cfg)
        if "error" in shape:
            return plain
        need, what, parts = host_need(cfg, shape)
    except Exception:  # advice is a courtesy: a config this version cannot read gets the plain word
        return plain
    return (f"a pod's processes need about {size(need)} by kubetrain's estimate ({what}; `kubetrain doctor CONFIG` "
            f"shows it); {pod_advice(cfg, parts)}")


def _when(pod: dict[str, Any], ended: dict[str, Any] | None) -> float:
    """When it failed: the container's finishedAt, else the pod's newest condition, else its creation."""
    status = pod.get("status") or {}
    times = [(ended or {}).get("finishedAt")]
    times += [c.get("lastTransitionTime") for c in status.get("conditions") or []]
    times.append(pod["metadata"].get("creationTimestamp"))
    for text in times:
        if text:
            try:
                return datetime.datetime.fromisoformat(str(text).replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return 0.0

"""The controllers behind the test API server: the Job and StatefulSet controllers, the scheduler and the
kubelet as tests move pods through their life, and Kueue. Each behaviour names where the real one does the same
(kubernetes/kubernetes, kubernetes-sigs/kueue paths); the HTTP side is tests/k8s/apiserver.py's ApiServer.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from typing import Any

from kubetrain.k8s.cluster.resources import RESOURCES, Resource
from tests.k8s import waiting_fakes

INDEX = "batch.kubernetes.io/job-completion-index"
# Kinds only the tests create (another client's objects): how they are stored and served.
KINDS = {**RESOURCES, "ResourceQuota": Resource("ResourceQuota", "v1", "resourcequotas")}


class Controllers:
    """What acts on the stored objects besides the API server itself; mixed into ApiServer, whose state it uses."""

    objects: dict[str, dict[str, Any]]
    logs: dict[str, str]
    previous_logs: dict[str, str]
    log_stamps: dict[str, list[int]]
    previous_stamps: dict[str, list[int]]
    break_streams: dict[str, str]
    stopped: set[str]
    instances: dict[str, int]
    unreported: dict[str, int]
    exit_reasons: dict[str, str]
    changed: threading.Condition
    crds: dict[str, dict[str, Any]]
    serial: int
    start_bare_pods: bool
    no_node_for_bare_pods: str | None
    job_controller: bool
    kueue: bool

    def install_crd(self, crd: dict[str, Any]) -> None:
        self.crds[crd["metadata"]["name"]] = crd

    def _next(self, prefix: str) -> str:
        self.serial += 1
        return f"{prefix}-{self.serial}" if prefix else f"{self.serial:05d}"

    def _now(self) -> str:
        self.serial += 1
        return f"2026-03-02T{self.serial // 3600 % 24:02d}:{self.serial // 60 % 60:02d}:{self.serial % 60:02d}Z"

    def install_kueue(self) -> None:
        """Kueue's CRDs served (kueue.x-k8s.io/v1beta1) and its webhook and job reconciler at work: a Job applied
        with a queue label is suspended, and gets a Workload (tests/k8s/waiting_fakes.py)."""
        self.kueue = True
        self.install_crd({"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
                          "metadata": {"name": "workloads.kueue.x-k8s.io"},
                          "spec": {"group": "kueue.x-k8s.io", "scope": "Namespaced",
                                   "names": {"kind": "Workload", "plural": "workloads"},
                                   "versions": [{"name": "v1beta1", "served": True, "storage": True}]}})

    def kueue_workload(self, job: str) -> dict[str, Any]:
        return next(o for o in self.objects.values() if o["kind"] == "Workload"
                    and o["metadata"]["ownerReferences"][0]["name"] == job)

    def kueue_pending(self, job: str, message: str) -> None:
        """Kueue's scheduler could not reserve quota: QuotaReserved False, reason Pending (pkg/scheduler)."""
        with self.changed:
            self.kueue_workload(job)["status"]["conditions"] = [
                waiting_fakes.workload_condition("QuotaReserved", False, "Pending", message, self._now())]
            self.changed.notify_all()

    def kueue_admit(self, job: str) -> None:
        """Quota reserved and admitted (no admission checks): Kueue's job reconciler unsuspends the Job."""
        with self.changed:
            workload = self.kueue_workload(job)
            workload["status"]["conditions"] = [
                waiting_fakes.workload_condition("QuotaReserved", True, "QuotaReserved",
                                                 "Quota reserved in ClusterQueue cluster-queue", self._now()),
                waiting_fakes.workload_condition("Admitted", True, "Admitted", "The workload is admitted",
                                                 self._now())]
            obj = next(o for o in self.objects.values() if o["kind"] == "Job" and o["metadata"]["name"] == job)
            obj["spec"]["suspend"] = False
            self._reconcile_job(obj)
            self.changed.notify_all()

    # -- pods, as the scheduler and the kubelet move them -----------------------------------------------

    def pods(self, job: str | None = None) -> list[dict[str, Any]]:
        return [o for o in self.objects.values() if o["kind"] == "Pod"
                and (job is None or (o["metadata"].get("labels") or {}).get("kubetrain.dev/job") == job)]

    def pod(self, job: str, rank: int) -> str:
        """The name of the newest pod of a rank."""
        pods = [p for p in self.pods(job) if _rank(p) == rank]
        return str(max(pods, key=lambda p: p["metadata"]["creationTimestamp"])["metadata"]["name"])

    def schedule(self, name: str, node: str = "node-a") -> None:
        """Bound to a node; the kubelet pulls the image: ContainerCreating."""
        def change(pod: dict[str, Any]) -> None:
            pod["spec"]["nodeName"] = node
            pod["status"]["conditions"] = [{"type": "PodScheduled", "status": "True"}]
            pod["status"]["containerStatuses"] = [_container(pod, {"waiting": {"reason": "ContainerCreating"}})]
        self._change_pod(name, change)

    def unschedulable(self, name: str, message: str) -> None:
        """The scheduler's verdict stays in the pod's PodScheduled condition (pkg/scheduler/schedule_one.go)."""
        def change(pod: dict[str, Any]) -> None:
            pod["status"]["conditions"] = [{"type": "PodScheduled", "status": "False",
                                            "reason": "Unschedulable", "message": message}]
        self._change_pod(name, change)

    def start(self, name: str, log: str = "", node: str = "node-a") -> None:
        def change(pod: dict[str, Any]) -> None:
            pod["spec"].setdefault("nodeName", node)
            pod["status"].update(phase="Running", containerStatuses=[
                _container(pod, {"running": {"startedAt": self._now()}}, ready=True)])
        self._change_pod(name, change)
        self.stopped.discard(name)
        self.write_log(name, log)

    def write_log(self, name: str, text: str) -> None:
        """The container writes; the runtime stamps each line as it takes it (the CRI log format's first field)."""
        with self.changed:
            self.logs[name] = self.logs.get(name, "") + text
            self.stamp_lines(self.log_stamps.setdefault(name, []), self.logs[name])
            self.changed.notify_all()

    def break_stream(self, name: str, how: str, log: str = "") -> None:
        """The pod's followed log breaks off while its container runs on and writes `log`: "end" (the answer is
        closed, as when the API server stops or a proxy's timeout ends a long request), "reset" (the connection
        drops before the last chunk), "stall" (it stays open and sends nothing, as from a kubelet on a node under
        memory pressure) or "kubelet-error" (the kubelet's error text ends the answer; see ApiServer._follow).
        The stream sends nothing more; a stream opened later reads on."""
        with self.changed:
            self.break_streams[name] = how
        self.write_log(name, log)

    @staticmethod
    def stamp_lines(stamps: list[int], text: str) -> list[int]:
        """Stamps (nanoseconds, increasing) for the lines of `text` that have none yet: now."""
        for _ in range(len(text.splitlines()) - len(stamps)):
            stamps.append(max(time.time_ns(), stamps[-1] + 1 if stamps else 0))
        return stamps

    def exit(self, name: str, code: int, log: str = "", reported: bool = True, reason: str | None = None) -> None:
        """The container ends; with `reported`, the kubelet reports it and the pod's controller reacts (a Job
        replaces a failed pod).

        Two acts of the kubelet, in this order: its followed log ends as soon as the container runtime says the
        container is not running (pkg/kubelet/kuberuntime/logs/logs.go, ReadLogs/waitLogs/isContainerRunning);
        the pod's status in the API server changes only when the kubelet's next PLEG relist (every second,
        genericPlegRelistPeriod in pkg/kubelet/kubelet.go) and its status manager (pkg/kubelet/status/
        status_manager.go, syncPod) get there. Until then the pod says `Running`, its container `running`.
        `reported=False` stops between the two acts; `report` plays the second. `reason`: the runtime's
        (OOMKilled for a cgroup OOM kill, with code 137), else Completed or Error."""
        self.write_log(name, log)
        with self.changed:
            self.stopped.add(name)
            self.unreported[name] = code
            self.exit_reasons[name] = reason or ("Completed" if code == 0 else "Error")
            self.changed.notify_all()
        if reported:
            self.report(name)

    def report(self, name: str) -> None:
        """The kubelet's status manager writes the ended container's state and the pod's terminal phase
        (restartPolicy Never). A pod being deleted (`deletionTimestamp`) is then deleted with grace 0 (syncPod's
        canBeDeleted); its Job replaces it at the controller's next `sync`, as `delete_pod` says."""
        code, reason = self.unreported.pop(name), self.exit_reasons.pop(name)
        finished = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())  # the runtime's clock, a real time

        def change(pod: dict[str, Any]) -> None:
            pod["status"].update(phase="Succeeded" if code == 0 else "Failed", containerStatuses=[
                _container(pod, {"terminated": {"exitCode": code, "reason": reason, "finishedAt": finished}})])

        pod = next(p for p in self.pods() if p["metadata"]["name"] == name)
        if not pod["metadata"].get("deletionTimestamp"):
            self._change_pod(name, change)
            return
        with self.changed:
            change(pod)
            del self.objects[_path_of(pod)]
            self.changed.notify_all()

    def evict(self, name: str, message: str) -> None:
        """The kubelet's eviction manager ends the pod (pkg/kubelet/eviction/eviction_manager.go, evictPod): its
        container is killed (137), the pod fails with reason Evicted and the resource in its message, and gets the
        DisruptionTarget condition, reason TerminationByKubelet (pkg/kubelet/status/status_manager.go), which a
        podFailurePolicy Ignore rule onPodConditions matches."""
        self.write_log(name, "")
        finished = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        with self.changed:
            self.stopped.add(name)

        def change(pod: dict[str, Any]) -> None:
            pod["status"].update(phase="Failed", reason="Evicted", message=message, containerStatuses=[
                _container(pod, {"terminated": {"exitCode": 137, "reason": "Error", "finishedAt": finished}})])
            pod["status"].setdefault("conditions", []).append(
                {"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet",
                 "message": message, "lastTransitionTime": finished})
        self._change_pod(name, change)

    def restart(self, name: str, code: int, log: str = "") -> None:
        """The kubelet restarts the container in place (restartPolicy Always or OnFailure): the instance that ended
        becomes `lastState.terminated` and its log stays readable with `previous=true` (one instance back); the new
        one starts an empty log (pkg/kubelet/kuberuntime/kuberuntime_container.go, kubelet_pods.go)."""
        self.write_log(name, log)

        def change(pod: dict[str, Any]) -> None:
            [container] = pod["status"]["containerStatuses"]
            container.update(state={"running": {"startedAt": self._now()}}, restartCount=container["restartCount"] + 1,
                             lastState={"terminated": {"exitCode": code, "reason": "Error" if code else "Completed",
                                                       "containerID": f"containerd://{self._next('container')}"}})
            self.previous_logs[name] = self.logs.pop(name, "")
            self.previous_stamps[name] = self.log_stamps.pop(name, [])
            self.instances[name] = self.instances.get(name, 0) + 1
        self._change_pod(name, change)

    def _change_pod(self, name: str, change: Callable[[dict[str, Any]], None]) -> None:
        with self.changed:
            pod = next(p for p in self.pods() if p["metadata"]["name"] == name)
            change(pod)
            for ref in pod["metadata"].get("ownerReferences") or []:
                owner = next((o for o in self.objects.values() if o["metadata"].get("uid") == ref["uid"]), None)
                if owner is not None:
                    self._reconcile(owner)
            self.changed.notify_all()

    # -- the controllers ---------------------------------------------------------------------------

    def _reconcile(self, owner: dict[str, Any]) -> None:
        if owner["kind"] == "Job":
            self._reconcile_job(owner)
        elif owner["kind"] == "StatefulSet":
            self._reconcile_statefulset(owner)

    def _reconcile_job(self, job: dict[str, Any]) -> None:
        """pkg/controller/job/job_controller.go, the parts a training job meets:

        - `active` counts every pod that is not finished, Pending ones included (a Job whose pods cannot be
          scheduled is "active");
        - a failed pod stays listed until the Job is deleted, and its index gets a new pod with a new name
          and the same `batch.kubernetes.io/job-completion-index` label; `failed` counts the failed pods
          except those a podFailurePolicy `Ignore` rule matched (and those are replaced too);
        - finishing adds `SuccessCriteriaMet` then `Complete`, or `FailureTarget` then `Failed` (a FailJob rule,
          or more failures than backoffLimit);
        - `spec.suspend`: no pod is created and active ones are deleted; condition `Suspended` True, reason
          JobSuspended; once resumed, `Suspended` False, reason JobResumed, and the pods are created;
        - a pod the API server refuses (an exceeded ResourceQuota) is not there: the controller records a
          `FailedCreate` event on the Job, "Error creating: " and the error (pkg/controller/controller_utils.go,
          createPods), and tries again at a later sync;
        - with `job_controller` off (a slow controller), nothing happens until `sync`.
        """
        if not self.job_controller:
            return
        spec, uid = job["spec"], job["metadata"]["uid"]
        pods = [p for p in self.pods() if any(r["uid"] == uid for r in p["metadata"].get("ownerReferences") or [])]
        suspended = bool(spec.get("suspend"))
        if suspended:
            for pod in [p for p in pods if p["status"].get("phase") in ("Pending", "Running")]:
                del self.objects[_path_of(pod)]
                pods.remove(pod)
        ignored, fail_job = 0, ""
        for pod in pods:
            if pod["status"].get("phase") == "Failed":
                action, message = _failure_action(spec.get("podFailurePolicy"), pod)
                ignored += action == "Ignore"
                fail_job = fail_job or message
        failed = sum(p["status"].get("phase") == "Failed" for p in pods) - ignored
        done = {_rank(p) for p in pods if p["status"].get("phase") == "Succeeded"}
        before = {c["type"]: c for c in job.get("status", {}).get("conditions", [])}
        conditions = [c for c in before if c != "Suspended"]
        finished = "Complete" in conditions or "Failed" in conditions
        why = {c: (before[c].get("reason"), before[c].get("message")) for c in conditions}
        if not finished and (fail_job or failed > spec.get("backoffLimit", 6)):
            conditions, finished = ["FailureTarget", "Failed"], True
            # job_controller.go: reason PodFailurePolicy with the rule's message, or BackoffLimitExceeded
            why["Failed"] = (("PodFailurePolicy", fail_job) if fail_job
                             else ("BackoffLimitExceeded", "Job has reached the specified backoff limit"))
            why["FailureTarget"] = why["Failed"]
        elif not finished and len(done) == spec["completions"]:
            conditions, finished = ["SuccessCriteriaMet", "Complete"], True
        for index in range(spec["completions"]):
            mine = [p for p in pods if _rank(p) == index]
            if finished or suspended or any(p["status"].get("phase") in ("Pending", "Running", "Succeeded")
                                            for p in mine):
                continue
            prefix = f"{job['metadata']['name']}-{index}-"  # the pod's generateName
            refused = waiting_fakes.quota_refusal(list(self.objects.values()), job["metadata"]["namespace"], prefix)
            if refused:
                self._event(job, "FailedCreate", f"Error creating: {refused}", "job-controller")
            else:
                pods.append(self._create_pod(job, index, f"{prefix}{self._next('')}"))
        status = [{"type": c, "status": "True", **({"reason": why[c][0], "message": why[c][1]}
                                                    if why.get(c, (None,))[0] else {})} for c in conditions]
        if suspended:
            status.append({"type": "Suspended", "status": "True", "reason": "JobSuspended", "message": "Job suspended"})
        elif "Suspended" in before:
            status.append({"type": "Suspended", "status": "False", "reason": "JobResumed", "message": "Job resumed"})
        live = [p for p in pods if p["status"].get("phase") in ("Pending", "Running")]
        job["status"] = {  # a pod being deleted is terminating, not active (controller.FilterActivePods)
            "active": sum(not p["metadata"].get("deletionTimestamp") for p in live),
            "terminating": sum(bool(p["metadata"].get("deletionTimestamp")) for p in live),
            "succeeded": len(done), "failed": failed, "conditions": status,
        }

    def sync(self, job: str | None = None) -> None:
        """The Job controller's next sync of a Job (or of all): after a slow start, after the backoff that
        follows a refused pod, or after a deleted pod is gone (it is replaced only then)."""
        with self.changed:
            for obj in list(self.objects.values()):
                if obj["kind"] == "Job" and job in (None, obj["metadata"]["name"]):
                    self._reconcile_job(obj)
            self.changed.notify_all()

    def delete_pod(self, name: str, code: int = 75, log: str = "", reported: bool = True) -> None:
        """`kubectl delete pod`, a graceful deletion: the API server sets `deletionTimestamp` and
        `deletionGracePeriodSeconds` (the pod's terminationGracePeriodSeconds, pkg/registry/core/pod/strategy.go
        CheckGracefulDelete) and the pod stays, `Running`; the kubelet sends SIGTERM and the container exits `code`
        (75 after its checkpoint), which ends its followed log (see `exit`). With `reported`, the kubelet then
        reports the terminal phase and deletes the pod (`report`).

        While it terminates the pod is not active, and its index gets no new pod: with a podFailurePolicy the Job
        controller replaces a pod only once it is terminal (onlyReplaceFailedPods; firstPendingIndexes in
        pkg/controller/job/indexed_job_utils.go counts terminating pods as not pending). Once it is gone, the
        replacement comes at the controller's next `sync` (after the pod failure backoff,
        DefaultJobPodFailureBackOff): until then neither pod exists."""
        with self.changed:
            pod = next(p for p in self.pods() if p["metadata"]["name"] == name)
            pod["metadata"].update(deletionTimestamp=self._now(),
                                   deletionGracePeriodSeconds=pod["spec"].get("terminationGracePeriodSeconds", 30))
            self.changed.notify_all()
        self.exit(name, code, log, reported)

    def _event(self, involved: dict[str, Any], reason: str, message: str, component: str) -> None:
        events = [o for o in self.objects.values() if o["kind"] == "Event"]
        event = waiting_fakes.record_event(events, involved, reason, message, component, self._now(),
                                           self.serial)
        if event is not None:
            self.objects[_path_of(event)] = event

    def _bare_pod(self, pod: dict[str, Any]) -> None:
        """A Pod created on its own starts Pending with no node; with `start_bare_pods`, the scheduler binds it
        and the kubelet starts its container at once (an image already on the node); with `no_node_for_bare_pods`,
        the scheduler finds no node and says why (pkg/scheduler/schedule_one.go, handleSchedulingFailure)."""
        pod["status"] = {"phase": "Pending"}
        if self.no_node_for_bare_pods:  # the scheduler's first attempt, in the PodScheduled condition
            pod["status"]["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                            "message": self.no_node_for_bare_pods}]
        elif self.start_bare_pods:
            pod["spec"]["nodeName"] = "node-a"
            pod["status"] = {"phase": "Running", "containerStatuses": [
                _container(pod, {"running": {"startedAt": self._now()}}, ready=True)]}

    def _reconcile_statefulset(self, sts: dict[str, Any]) -> None:
        """pkg/controller/statefulset: pod i is `<name>-i`, labelled apps.kubernetes.io/pod-index; the
        kubelet restarts a container that exits (restartPolicy Always), so a pod never finishes."""
        name = sts["metadata"]["name"]
        for index in range(sts["spec"]["replicas"]):
            path = RESOURCES["Pod"].path(sts["metadata"]["namespace"], f"{name}-{index}")
            if path not in self.objects:
                self._create_pod(sts, index, f"{name}-{index}", {"apps.kubernetes.io/pod-index": str(index)})
        ready = sum(p["status"].get("phase") == "Running" for p in self.pods(name))
        sts["status"] = {"replicas": sts["spec"]["replicas"], "readyReplicas": ready}

    def _create_pod(self, owner: dict[str, Any], index: int, name: str,
                    labels: dict[str, str] | None = None) -> dict[str, Any]:
        template = copy.deepcopy(owner["spec"]["template"])
        meta = template.get("metadata") or {}
        if owner["kind"] == "Job":
            labels = {INDEX: str(index), "job-name": owner["metadata"]["name"]}
            meta["annotations"] = {**(meta.get("annotations") or {}), INDEX: str(index)}
        pod = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {**meta, "name": name, "namespace": owner["metadata"]["namespace"],
                         "labels": {**(meta.get("labels") or {}), **(labels or {})},
                         "uid": self._next("uid"), "creationTimestamp": self._now(),
                         "ownerReferences": [{"apiVersion": owner["apiVersion"], "kind": owner["kind"],
                                              "name": owner["metadata"]["name"], "uid": owner["metadata"]["uid"],
                                              "controller": True}]},
            "spec": template["spec"],
            "status": {"phase": "Pending"},
        }
        self.objects[_path_of(pod)] = pod
        return pod



def _path_of(obj: dict[str, Any]) -> str:
    res: Resource = KINDS[obj["kind"]]
    return res.path(obj["metadata"].get("namespace"), obj["metadata"]["name"])


def _rank(pod: dict[str, Any]) -> int:
    labels = pod["metadata"].get("labels") or {}
    return int(labels.get(INDEX, labels.get("apps.kubernetes.io/pod-index", -1)))


def _container(pod: dict[str, Any], state: dict[str, Any], ready: bool = False) -> dict[str, Any]:
    return {"name": pod["spec"]["containers"][0]["name"], "state": state, "ready": ready, "restartCount": 0}


def _failure_action(policy: dict[str, Any] | None, pod: dict[str, Any]) -> tuple[str | None, str]:
    """The action of the first podFailurePolicy rule whose exit codes match the failed container, and for FailJob
    the message the Job's Failed condition carries (pkg/controller/job/pod_failure_policy.go,
    matchPodFailurePolicy; an onPodConditions rule matches a condition with status True, as `evict` sets)."""
    statuses = pod["status"].get("containerStatuses") or []
    code = ((statuses[0].get("state") or {}).get("terminated") or {}).get("exitCode") if statuses else None
    conditions = {c.get("type") for c in pod["status"].get("conditions") or [] if c.get("status") == "True"}
    for index, rule in enumerate((policy or {}).get("rules", [])):
        if any(p.get("type") in conditions for p in rule.get("onPodConditions") or []):
            return str(rule["action"]), ""
        match = rule.get("onExitCodes")
        if match and code is not None and (code in match["values"]) == (match["operator"] == "In"):
            action = str(rule["action"])
            meta = pod["metadata"]
            message = (f"Container {statuses[0]['name']} for pod {meta['namespace']}/{meta['name']} failed with exit "
                       f"code {code} matching {action} rule at index {index}") if action == "FailJob" else ""
            return action, message
    return None, ""

"""The one table of workloads, and the names kubetrain writes on the cluster.

Each workload kubetrain can launch: its kind, apiVersion and plural, what to install when the cluster lacks
its CRD, which conditions end it, and how its pods say their node rank. Render, launch, stop, status and
list all read it from here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

JOB_LABEL = "kubetrain.dev/job"  # on every object and pod of a job: how all of them are found
WORKLOAD_LABEL = "kubetrain.dev/workload"  # the workload that was launched, so stop/status act on that kind
SPEC_HASH = "kubetrain.dev/spec-hash"  # of everything rendered: an unchanged relaunch is a no-op
MANAGED_BY = "kubetrain"
FIELD_MANAGER = "kubetrain"  # server-side apply, and the TrainJob's runtime patch
# Deleted with the workload (by `stop`, and by the garbage collector once ttlSecondsAfterFinished removes it);
# launch makes the workload their owner from their first apply.
OWNED_KINDS = ("ConfigMap", "NetworkPolicy", "Service")
INDEX_KEY = "batch.kubernetes.io/job-completion-index"
# Kubeflow training-operator's `restartPolicy: ExitCode` (pkg/controller.v1/common/pod.go, v1.9.0): a pod that exits
# 1-127 fails the PyTorchJob at once, one that exits 128-255 is deleted and created again. Bad input (2) and a failed
# preflight (71) are to end the job, as a Job's podFailurePolicy ends it; a pod that stopped after a checkpoint (75) or
# lost its rendezvous host (69) is to be replaced. Under this policy the entrypoint exits those two as 128 + code
# (203, 197: above 128 + 64, so no signal can be read into them).
EXIT_CODE_POLICY_ENV = "KUBETRAIN_EXIT_CODE_POLICY"
KUBEFLOW_EXIT_CODE = "kubeflow-exitcode"
RETRYABLE_EXIT_CODES = (75, 69)  # errors.EXIT_STOPPED_RESUMABLE, errors.EXIT_PEER_LOST
RETRYABLE_OFFSET = 128
# What a StatefulSet pod's entrypoint logs once training finished: the pod idles instead of exiting.
IDLE_MARKER = "training finished; idling"
_ORDINAL = re.compile(r"-(\d+)$")


@dataclass(frozen=True)
class Workload:
    name: str  # the value of k8s.workload
    kind: str
    api_version: str
    plural: str
    operator: str | None  # what to install when the cluster does not serve it (None: built into Kubernetes)
    succeeded: str | None  # the condition type that says it finished well (None: it never finishes)
    failed: str | None

    @property
    def custom(self) -> bool:
        return self.operator is not None


WORKLOADS = {
    w.name: w
    for w in (
        Workload("indexed-job", "Job", "batch/v1", "jobs", None, "Complete", "Failed"),
        Workload("jobset", "JobSet", "jobset.x-k8s.io/v1alpha2", "jobsets", "JobSet (jobset.x-k8s.io)",
                 "Completed", "Failed"),
        Workload("trainjob", "TrainJob", "trainer.kubeflow.org/v1alpha1", "trainjobs", "Kubeflow Trainer v2",
                 "Complete", "Failed"),
        Workload("pytorchjob", "PyTorchJob", "kubeflow.org/v1", "pytorchjobs", "Kubeflow training-operator",
                 "Succeeded", "Failed"),
        # A StatefulSet restarts whatever exits: its pods idle after training (see pod/entrypoint.py).
        Workload("statefulset", "StatefulSet", "apps/v1", "statefulsets", None, None, None),
    )
}
BY_KIND = {w.kind: w for w in WORKLOADS.values()}


def pod_selector(name: str) -> str:
    """The label selector of every pod of a job, whatever its workload."""
    return f"{JOB_LABEL}={name}"


def main_container(pod: dict[str, Any]) -> str:
    """The name of a pod's training container (kubectl's default container, else the first)."""
    annotations = pod["metadata"].get("annotations") or {}
    return str(
        annotations.get("kubectl.kubernetes.io/default-container") or pod["spec"]["containers"][0]["name"]
    )


def node_rank(pod: dict[str, Any]) -> int | None:
    """The node rank a pod's controller gave it, from the labels and annotations the controllers set."""
    meta = pod.get("metadata", {})
    labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
    replica_type = labels.get("training.kubeflow.org/replica-type")
    if replica_type is not None:  # PyTorchJob: master 0, worker i is node i + 1
        replica = int(labels.get("training.kubeflow.org/replica-index", 0))
        return 0 if replica_type.lower() == "master" else replica + 1
    index = annotations.get(INDEX_KEY) or labels.get(INDEX_KEY)
    if index is not None:  # Indexed Job, and the single replicated Job of a JobSet or TrainJob
        return int(index)
    if "apps.kubernetes.io/pod-index" in labels:
        return int(labels["apps.kubernetes.io/pod-index"])
    match = _ORDINAL.search(meta.get("name", ""))
    return int(match.group(1)) if match else None


def conditions(obj: dict[str, Any]) -> set[str]:
    return {c["type"] for c in (obj.get("status") or {}).get("conditions") or [] if c.get("status") == "True"}


def finished(obj: dict[str, Any]) -> str | None:
    """'succeeded' or 'failed' once the workload's controller says it is over; None while it is not."""
    wl = BY_KIND[obj["kind"]]
    true = conditions(obj)
    if wl.failed in true:
        return "failed"
    if wl.succeeded in true:
        return "succeeded"
    return None


def pod_exit_code(code: int, policy: str | None) -> int:
    """The exit code a pod gives its controller: under Kubeflow's ExitCode policy a resumable one is moved above 128
    (retried by the operator); every other code, and every code under any other controller, is kubetrain's own."""
    if policy == KUBEFLOW_EXIT_CODE and code in RETRYABLE_EXIT_CODES:
        return RETRYABLE_OFFSET + code
    return code


def kubetrain_exit_code(code: int) -> int:
    """kubetrain's exit code behind a pod's: the inverse of pod_exit_code (203 is 75, 197 is 69)."""
    return code - RETRYABLE_OFFSET if code - RETRYABLE_OFFSET in RETRYABLE_EXIT_CODES else code

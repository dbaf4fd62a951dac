"""The PyTorchJob's restarts, read as Kubeflow training-operator v1.9.0 reads them: a failed preflight or bad input
ends the job at once, a pod stopped after a checkpoint (or one that lost its rendezvous host) is created again."""

from __future__ import annotations

from typing import Any

import pytest

from kubetrain.config import load_config
from kubetrain.errors import EXIT_BAD_INPUT, EXIT_PEER_LOST, EXIT_PREFLIGHT, EXIT_STOPPED_RESUMABLE
from kubetrain.k8s.cluster.failures import pod_failure
from kubetrain.k8s.render import validate
from kubetrain.k8s.render.manifest import render
from kubetrain.k8s.workloads import EXIT_CODE_POLICY_ENV, pod_exit_code


def training_operator(replica: dict[str, Any], exit_code: int) -> str:
    """What training-operator v1.9.0 does with a replica's pod that ended with `exit_code`.

    pkg/core/pod.go, SetRestartPolicy: under ExitCode the pod's own restartPolicy is Never, else the replica's.
    pkg/controller.v1/common/pod.go, ReconcilePods: a Failed pod under ExitCode with a code >= 128
    (pkg/util/train/train_util.go, IsRetryableExitCode), or under OnFailure/Always, is restarted; under ExitCode
    with a code below 128 the job gets its Failed condition. Under OnFailure/Always the kubelet restarts the
    container in the same pod, on the same node; under ExitCode the operator deletes the pod and creates another.
    """
    policy = replica["restartPolicy"]
    if policy in ("OnFailure", "Always"):
        return "restarted in place"
    if policy == "ExitCode":
        return "created again" if exit_code >= 128 else "failed"
    return "failed"  # Never: no restart, the job fails once its pods have


def _env(replica: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value") for e in replica["template"]["spec"]["containers"][0]["env"]}


@pytest.mark.parametrize(("code", "outcome"), [
    (EXIT_PREFLIGHT, "failed"),  # the same node would fail the same way
    (EXIT_BAD_INPUT, "failed"),  # a restart cannot fix the config
    (EXIT_STOPPED_RESUMABLE, "created again"),  # SIGTERM after a checkpoint: resumes from it
    (EXIT_PEER_LOST, "created again"),  # the rendezvous host went away: not this pod's fault
])
def test_each_exit_ends_or_replaces_the_pytorchjob_as_a_jobs_pod_failure_policy_does(
        code: int, outcome: str, crd_schemas: Any) -> None:
    cfg = load_config(None, "tiny", ["k8s.nnodes=2", "k8s.volumes.checkpoints.access_mode=ReadWriteMany"])
    objects = render(cfg, "pytorchjob")
    assert validate.problems(objects, crd_schemas) == []
    for role, replica in objects[-1]["spec"]["pytorchReplicaSpecs"].items():
        pod_code = pod_exit_code(code, _env(replica).get(EXIT_CODE_POLICY_ENV))
        assert training_operator(replica, pod_code) == outcome, (role, code, pod_code)
        assert replica["template"]["spec"]["restartPolicy"] == "Never"  # what the operator sets under ExitCode


@pytest.mark.parametrize("code", [EXIT_STOPPED_RESUMABLE, EXIT_PEER_LOST])
def test_a_replaced_pods_exit_is_no_failure_in_status(code: int) -> None:
    """The moved codes (203, 197) read back as kubetrain's own: `k8s status` names no failure for them."""
    moved = pod_exit_code(code, "kubeflow-exitcode")
    assert moved >= 128 + 65  # no signal number reaches it: it cannot be read as "killed by signal N"
    pod = {"metadata": {"name": "job-worker-0", "labels": {"training.kubeflow.org/replica-type": "worker",
                                                           "training.kubeflow.org/replica-index": "0"}},
           "spec": {"containers": [{"name": "pytorch"}], "nodeName": "node-a"},
           "status": {"phase": "Failed", "containerStatuses": [
               {"name": "pytorch", "state": {"terminated": {"exitCode": moved, "reason": "Error"}}}]}}
    assert pod_failure(pod) is None
    pod["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] = EXIT_PREFLIGHT
    failure = pod_failure(pod)
    assert failure is not None and failure["exit_code"] == EXIT_PREFLIGHT


"""Kubeflow PyTorchJob (training-operator v1): a Master and nnodes - 1 Workers.

The operator names the master `<job>-master-0`, sets MASTER_ADDR/MASTER_PORT (from the port named
`pytorchjob-port` of the container named `pytorch`), RANK, WORLD_SIZE and PET_NNODES/PET_NODE_RANK.

Restarts follow the pod's exit code (`restartPolicy: ExitCode`, workloads.py says how the operator reads it): bad
input (2), a failed preflight (71) and a run that failed after torchrun's own restarts inside the pod (1) fail the
job at once, saying which replica failed; a pod stopped after a checkpoint or one that lost its rendezvous host is
created again, wherever the scheduler puts it. `OnFailure` restarted every failure in place, on the same node: a
bad device was met again until the restarts counted against backoffLimit ran out, without a word of why.
"""

from __future__ import annotations

from typing import Any

from kubetrain.k8s.render import podspec
from kubetrain.k8s.render.context import RenderContext
from kubetrain.k8s.workloads import EXIT_CODE_POLICY_ENV, KUBEFLOW_EXIT_CODE

CONTAINER = "pytorch"
PORT_NAME = "pytorchjob-port"


def render(ctx: RenderContext) -> list[dict[str, Any]]:
    k = ctx.k

    def replica(count: int) -> dict[str, Any]:
        # the operator sets the pod's own restartPolicy to Never under ExitCode (pkg/core/pod.go, SetRestartPolicy)
        template = podspec.pod_template(
            ctx, restart_policy="Never", container_name=CONTAINER, rdzv_port_name=PORT_NAME,
            extra_env={EXIT_CODE_POLICY_ENV: KUBEFLOW_EXIT_CODE},
        )
        # a replaced pod resumes from the checkpoint claim
        return {"replicas": count, "restartPolicy": "ExitCode", "template": template}

    replicas = {"Master": replica(1)}
    if k.nnodes > 1:
        replicas["Worker"] = replica(k.nnodes - 1)
    run_policy: dict[str, Any] = {"cleanPodPolicy": "None", "backoffLimit": k.backoff_limit}
    if k.ttl_seconds_after_finished is not None:
        run_policy["ttlSecondsAfterFinished"] = k.ttl_seconds_after_finished
    if k.active_deadline_seconds:
        run_policy["activeDeadlineSeconds"] = k.active_deadline_seconds
    if k.priority_class_name:
        run_policy["schedulingPolicy"] = {"priorityClass": k.priority_class_name}
    return [
        {
            **ctx.workload_meta(),
            "spec": {
                "nprocPerNode": str(k.nproc_per_node),
                "runPolicy": run_policy,
                "pytorchReplicaSpecs": replicas,
            },
        }
    ]

"""Kubeflow PyTorchJob (training-operator v1): a Master and nnodes - 1 Workers.

The operator names the master `<job>-master-0`, sets MASTER_ADDR/MASTER_PORT (from the port named
`pytorchjob-port` of the container named `pytorch`), RANK, WORLD_SIZE and PET_NNODES/PET_NODE_RANK.
"""

from __future__ import annotations

from typing import Any

from kubetrain.k8s.render import podspec
from kubetrain.k8s.render.context import RenderContext

CONTAINER = "pytorch"
PORT_NAME = "pytorchjob-port"


def render(ctx: RenderContext) -> list[dict[str, Any]]:
    k = ctx.k

    def replica(count: int) -> dict[str, Any]:
        template = podspec.pod_template(
            ctx, restart_policy="OnFailure", container_name=CONTAINER, rdzv_port_name=PORT_NAME
        )
        # OnFailure restarts the container in place, keeping the pod's node; the run resumes from the PVC.
        return {"replicas": count, "restartPolicy": "OnFailure", "template": template}

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

"""Kubeflow Trainer v2 TrainJob on a torch-distributed ClusterTrainingRuntime.

The runtime owns the JobSet, its Service, probes and failure policy; kubetrain sets the trainer (image,
command, nodes, resources, env) and patches the pod's security context, volumes and scheduling through
`runtimePatches`. The runtime sets PET_NNODES, PET_NODE_RANK and PET_MASTER_ADDR/PORT (port 29400).
"""

from __future__ import annotations

from typing import Any

from kubetrain.k8s.render import podspec
from kubetrain.k8s.render.context import RenderContext
from kubetrain.k8s.workloads import FIELD_MANAGER

NODE = "node"  # the runtime's replicated job and container name
RUNTIME_PORT = 29400


def render(ctx: RenderContext) -> list[dict[str, Any]]:
    k = ctx.k
    pod = podspec.pod_template(ctx, restart_policy="Never", container_name=NODE)
    main = pod["spec"]["containers"][0]
    env = main["env"]
    pod_patch: dict[str, Any] = {
        "securityContext": pod["spec"]["securityContext"],
        "terminationGracePeriodSeconds": pod["spec"]["terminationGracePeriodSeconds"],
        "volumes": pod["spec"]["volumes"],
        "containers": [
            {"name": NODE, "securityContext": main["securityContext"], "volumeMounts": main["volumeMounts"]}
        ],
    }
    for key in ("nodeSelector", "tolerations", "affinity", "imagePullSecrets", "serviceAccountName"):
        if key in pod["spec"]:
            pod_patch[key] = pod["spec"][key]
    trainer: dict[str, Any] = {
        "image": main["image"],  # a GPU pod's default image is the -cuda build (podspec.image)
        "command": main["command"],
        "args": main["args"],
        "env": env,
        "numNodes": k.nnodes,
        "numProcPerNode": k.nproc_per_node,
        "resourcesPerNode": main["resources"],
    }
    patch = {
        "manager": FIELD_MANAGER,
        "trainingRuntimeSpec": {
            "template": {
                "spec": {
                    "replicatedJobs": [
                        {
                            "name": NODE,
                            "template": {
                                "spec": {"template": {"metadata": pod["metadata"], "spec": pod_patch}}
                            },
                        }
                    ]
                }
            }
        },
    }
    return [
        {
            **ctx.workload_meta(),
            "spec": {
                "runtimeRef": {
                    "apiGroup": "trainer.kubeflow.org",
                    "kind": "ClusterTrainingRuntime",
                    "name": k.trainjob_runtime,
                },
                "trainer": trainer,
                "runtimePatches": [patch],
            },
        }
    ]

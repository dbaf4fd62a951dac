"""StatefulSet + headless Service: the node rank is the pod ordinal, rank 0 is `<job>-0.<job>`.

A StatefulSet restarts containers that exit, so a finished pod idles instead of training again;
`kubetrain k8s stop` removes it (the claims stay).
"""

from __future__ import annotations

from typing import Any

from kubetrain.k8s.render import podspec
from kubetrain.k8s.render.context import RenderContext
from kubetrain.k8s.render.objects import headless_service


def render(ctx: RenderContext) -> list[dict[str, Any]]:
    k = ctx.k
    template = podspec.pod_template(
        ctx,
        restart_policy="Always",
        extra_env={
            "MASTER_ADDR": f"{ctx.name}-0.{ctx.name}",
            "MASTER_PORT": str(k.rdzv_port),
            "KUBETRAIN_STATEFULSET": "1",
        },
        extra_args=("--idle-after-finish",),
    )
    sts = {
        **ctx.workload_meta(),
        "spec": {
            "serviceName": ctx.name,
            "replicas": k.nnodes,
            "podManagementPolicy": "Parallel",  # every node must be up for the rendezvous, not one by one
            "selector": {"matchLabels": ctx.selector},
            "template": template,
        },
    }
    return [headless_service(ctx), sts]

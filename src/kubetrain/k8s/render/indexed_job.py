"""Indexed Job + headless Service (needs no operator): pod i is `<job>-i.<job>`, node rank i."""

from __future__ import annotations

from typing import Any

from kubetrain.errors import EXIT_BAD_INPUT, EXIT_PEER_LOST, EXIT_PREFLIGHT, EXIT_STOPPED_RESUMABLE
from kubetrain.k8s.render import podspec
from kubetrain.k8s.render.context import RenderContext
from kubetrain.k8s.render.objects import headless_service


def pod_failure_policy(container: str) -> dict[str, Any]:
    """What a failed pod means to the Job.

    Preemption and eviction (DisruptionTarget), and a pod that stopped on SIGTERM after saving a checkpoint
    (exit 75), are not failures: they do not count against backoffLimit and the pod is replaced, resuming
    from the checkpoint. Bad input (exit 2) fails the Job at once, since retrying cannot help. A pod whose
    rendezvous host was lost (exit 69, pod/entrypoint.py) is replaced without counting: the lost host's pod
    counts once, so a job survives as many host losses as its backoffLimit allows. A preflight that named a bad
    device or link on this pod's node (exit 71, distributed/preflight.py) fails the Job before training: a
    replacement pod would land on the same node and fail again, and the Job's condition then names the pod.
    """
    def on_exit(action: str, code: int) -> dict[str, Any]:
        return {"action": action, "onExitCodes": {"containerName": container, "operator": "In", "values": [code]}}

    return {
        "rules": [
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            on_exit("Ignore", EXIT_STOPPED_RESUMABLE),
            on_exit("FailJob", EXIT_BAD_INPUT),
            on_exit("Ignore", EXIT_PEER_LOST),
            on_exit("FailJob", EXIT_PREFLIGHT),
        ]
    }


def job_spec(ctx: RenderContext, template: dict[str, Any], with_ttl: bool = True) -> dict[str, Any]:
    k = ctx.k
    spec: dict[str, Any] = {
        "completionMode": "Indexed",
        "completions": k.nnodes,
        "parallelism": k.nnodes,
        "backoffLimit": k.backoff_limit,
        "podFailurePolicy": pod_failure_policy("trainer"),
        "template": template,
    }
    if with_ttl and k.ttl_seconds_after_finished is not None:
        spec["ttlSecondsAfterFinished"] = k.ttl_seconds_after_finished
    if k.active_deadline_seconds:
        spec["activeDeadlineSeconds"] = k.active_deadline_seconds
    return spec


def render(ctx: RenderContext) -> list[dict[str, Any]]:
    template = podspec.pod_template(
        ctx,
        restart_policy="Never",  # podFailurePolicy needs it; the Job replaces a failed pod instead
        subdomain=ctx.name,
        extra_env={"MASTER_ADDR": f"{ctx.name}-0.{ctx.name}", "MASTER_PORT": str(ctx.k.rdzv_port)},
    )
    job = {
        **ctx.workload_meta(),
        "spec": job_spec(ctx, template),
    }
    return [headless_service(ctx), job]

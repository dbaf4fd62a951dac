"""Indexed Job + headless Service (needs no operator): pod i is `<job>-i.<job>`, node rank i."""

from __future__ import annotations

from typing import Any

from kubetrain.k8s.render import podspec
from kubetrain.k8s.render.context import RenderContext
from kubetrain.k8s.render.objects import headless_service

# Exit code 2 is bad input (a config error): retrying cannot help, so the job fails at once.
BAD_INPUT_EXIT = 2


def pod_failure_policy(container: str) -> dict[str, Any]:
    """Preemption and eviction (DisruptionTarget) do not count against backoffLimit; bad input fails now."""
    return {
        "rules": [
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            {
                "action": "FailJob",
                "onExitCodes": {"containerName": container, "operator": "In", "values": [BAD_INPUT_EXIT]},
            },
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
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": ctx.meta(ctx.name, ctx.workload_labels),
        "spec": job_spec(ctx, template),
    }
    return [headless_service(ctx), job]

"""JobSet: one replicated Indexed Job of nnodes pods; JobSet makes the headless Service itself."""

from __future__ import annotations

from typing import Any

from kubetrain.k8s.render import podspec
from kubetrain.k8s.render.context import RenderContext
from kubetrain.k8s.render.indexed_job import job_spec

REPLICATED_JOB = "node"
JOB_INDEX_ANNOTATION = "jobset.sigs.k8s.io/job-index"


def render(ctx: RenderContext) -> list[dict[str, Any]]:
    k = ctx.k
    # Pod hostnames are <jobset>-<replicatedJob>-<jobIndex>-<podIndex> under the subdomain <jobset>.
    template = podspec.pod_template(
        ctx,
        restart_policy="Never",
        extra_env={
            "MASTER_ADDR": f"{ctx.name}-{REPLICATED_JOB}-0-0.{ctx.name}",
            "MASTER_PORT": str(k.rdzv_port),
            "KUBETRAIN_PODS_PER_JOB": str(k.nnodes),
        },
    )
    # The node rank is job index * pods per job + completion index (k8s.pod.node).
    template["spec"]["containers"][0]["env"].append(
        {
            "name": "JOBSET_JOB_INDEX",
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{JOB_INDEX_ANNOTATION}']"}},
        }
    )
    spec: dict[str, Any] = {
        "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True, "subdomain": ctx.name},
        # The Job's backoffLimit handles pod failures; a failed Job restarts the whole set this many times, unless
        # its podFailurePolicy failed it (bad input, 2; a bad device or link, 71): a restart would fail the same way
        # (the Job's reason is then PodFailurePolicy, batch/v1's JobReasonPodFailurePolicy).
        "failurePolicy": {
            "maxRestarts": k.backoff_limit,
            "rules": [{"name": "FailOnPodFailurePolicy", "action": "FailJobSet",
                       "onJobFailureReasons": ["PodFailurePolicy"]}],
        },
        "replicatedJobs": [
            {
                "name": REPLICATED_JOB,
                "replicas": 1,
                "template": {
                    "metadata": {"labels": ctx.labels},
                    "spec": job_spec(ctx, template, with_ttl=False),
                },
            }
        ],
    }
    if k.ttl_seconds_after_finished is not None:
        spec["ttlSecondsAfterFinished"] = k.ttl_seconds_after_finished
    return [
        {
            **ctx.workload_meta(),
            "spec": spec,
        }
    ]

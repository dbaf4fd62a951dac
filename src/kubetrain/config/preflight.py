"""The `dist.preflight:` section: the job-wide check of every rank's device and links before step 1."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kubetrain.config.section import Section


class PreflightConfig(Section):
    """What the preflight checks within its budget, and what a failed check does."""

    enabled: bool = Field(
        True, description="Before the model is built, every rank of a job of more than one process checks its device "
        "(a matmul against a CPU reference, most of the free memory, the driver's error counters) and its links "
        "(all-reduce bus bandwidth and latency, send/recv with its neighbours) and the ranks' clocks; a rank that "
        "fails is named with its pod and node (distributed/preflight.py). `dist.preflight: false` turns it off."
    )
    budget_seconds: float = Field(
        20.0, gt=0, le=600, description="Time the preflight may take; the all-reduce and send/recv sizes "
        "(1 MiB to 256 MiB) stop growing where the next would not fit (on the CPU over gloo that is a few MiB)."
    )
    min_bandwidth_fraction: float = Field(
        0.5, gt=0, le=1, description="A rank whose all-reduce bus bandwidth, or a link whose send/recv bandwidth, "
        "is below this fraction of the job's median fails the preflight."
    )
    floor_gb_per_second: float | None = Field(
        None, gt=0, description="Absolute floor (GB/s, 1e9 bytes) under which a rank's all-reduce bus bandwidth or a "
        "link's send/recv bandwidth fails the preflight, whatever the median (null: the median's fraction only)."
    )
    on_failure: Literal["auto", "stop", "warn"] = Field(
        "auto", description="stop: the job ends before training with exit code 71 (a rendered Job's "
        "podFailurePolicy fails the Job, naming the node); warn: the named ranks are printed and training goes on; "
        "auto: stop in a pod rendered by kubetrain, warn elsewhere (`kubetrain train --nproc N`)."
    )

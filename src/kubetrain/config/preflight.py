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
        "(the job's all-reduce bus bandwidth, send/recv with its ring neighbours, each link judged among the links of "
        "its class: within a node or across nodes) and the ranks' clocks; a rank or link that fails is named with its "
        "pod and node (distributed/preflight.py). `dist.preflight: false` turns it off."
    )
    budget_seconds: float = Field(
        20.0, gt=0, le=600, description="Time the preflight's measurements may take; the all-reduce and send/recv "
        "sizes (1 MiB to 256 MiB) stop growing where the next would not fit (on the CPU over gloo that is a few MiB). "
        "A rank that has not finished the preflight after the budget plus a margin (a quarter of the budget, at least "
        "10 s) is named by its peers through the rendezvous store, and the job ends then."
    )
    min_bandwidth_fraction: float = Field(
        0.5, gt=0, le=1, description="A link whose send/recv bandwidth is below this fraction of the median of the "
        "other links of its class (within one node, or across nodes) is named, as a warning. It stops the job "
        "(on_failure) only when certain: 4x below that median on both of two looks."
    )
    all_reduce_floor_gb_per_second: float | None = Field(
        None, gt=0, description="Floor (GB/s, 1e9 bytes) of the job's all-reduce bus bandwidth (nccl-tests' busbw). "
        "The all-reduce is one figure for the whole job: a collective ends together on every rank, so it names no "
        "rank (null: no floor)."
    )
    same_node_floor_gb_per_second: float | None = Field(
        None, gt=0, description="Floor (GB/s) of a send/recv link between two ranks of one node (NVLink, PCIe, shared "
        "memory); a link under it is named whatever the class's median (null: the median's fraction only)."
    )
    across_nodes_floor_gb_per_second: float | None = Field(
        None, gt=0, description="Floor (GB/s) of a send/recv link between ranks on two nodes (InfiniBand, Ethernet); "
        "a link under it is named whatever the class's median (null: the median's fraction only)."
    )
    on_failure: Literal["auto", "stop", "warn"] = Field(
        "auto", description="What a certain problem does (a device that computes wrong or reports an uncorrectable "
        "memory error, a link 4x below its class on two looks, a floor missed on two looks): stop: the job ends "
        "before training with exit code 71 (a rendered Job's podFailurePolicy fails the Job, naming the node); warn: "
        "it is printed and training goes on; auto: stop in a pod rendered by kubetrain, warn elsewhere "
        "(`kubetrain train --nproc N`). A problem that is not certain is a warning under every setting."
    )

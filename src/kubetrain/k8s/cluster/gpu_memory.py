"""`k8s doctor`'s GPU memory line: one process's training state (the estimate train, the launcher, doctor and
render make, kubetrain.memory, for the pods' layout) against the memory of the GPUs the job's nodes have.

A node tells its GPUs' memory through NVIDIA's GPU feature discovery (part of the GPU operator): the label
`nvidia.com/gpu.memory`, in MiB. Nodes without it are not judged.
"""

from __future__ import annotations

from typing import Any

from kubetrain.config.schema import Config
from kubetrain.k8s.render.memory import on_gpu, pod_estimate, size
from kubetrain.memory import model_shape

GPU_MEMORY_LABEL = "nvidia.com/gpu.memory"  # MiB of one GPU (gpu-feature-discovery)


def gpu_memory_verdict(cfg: Config, nodes: list[dict[str, Any]]) -> tuple[str, str] | None:
    """(status, detail) for GPU pods, None for CPU pods or with run.check_memory false."""
    if not on_gpu(cfg) or not cfg.run.check_memory:
        return None
    shape = model_shape(cfg)
    if "error" in shape:
        return "warn", f"not estimated: {shape['error']}"
    est = pod_estimate(cfg, shape)
    lay = est.layout
    need = f"{size(est.per_process)} per process of {lay.world_size} ({lay.name})"
    selector = cfg.k8s.node_selector
    sizes = {}
    for node in nodes:
        labels = node["metadata"].get("labels") or {}
        if any(labels.get(key) != value for key, value in selector.items()):
            continue
        if labels.get(GPU_MEMORY_LABEL, "").isdigit():
            sizes[node["metadata"]["name"]] = int(labels[GPU_MEMORY_LABEL]) * 2**20
    if not sizes:
        return "ok", f"{need}; the nodes do not say their GPUs' memory (label {GPU_MEMORY_LABEL})"
    small = sorted(name for name, total in sizes.items() if total < est.per_process)
    smallest = min(sizes.values())
    if len(small) == len(sizes):
        return "fail", (f"{need} is more than the {size(smallest)} of the nodes' GPUs; shard it with "
                        "dist.strategy=fsdp, lower train.micro_batch_size or set model.gradient_checkpointing=true")
    if small:
        return "warn", f"{need} is more than the GPUs of {', '.join(small)} hold: pin the job to the others"
    return "ok", f"{need} fits the {size(smallest)} of the smallest of the nodes' GPUs"

"""Device facts the loop needs: mixed precision, peak FLOPS for MFU, memory in use."""

from __future__ import annotations

import contextlib
import platform
import re
import resource
import sys
from collections.abc import Callable

import torch

# Dense bf16/fp16 tensor-core peak per GPU (FLOP/s), from the vendors' data sheets; MFU is shown only when known.
# Keys are whole model names: "L4" must not match an L40, nor "A10" an A10G (a substring match did; an A10G
# has no published dense peak, so its MFU is not shown).
PEAK_FLOPS: dict[str, float] = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "A10": 125e12,
    "L40S": 362e12,
    "L40": 181e12,
    "L4": 121e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
    "V100": 125e12,
    "T4": 65e12,
    "MI300X": 1307e12,
    "MI250X": 383e12,
}


def peak_flops_of(name: str) -> float | None:
    """The dense bf16 peak of a device by its name ("NVIDIA H100 80GB HBM3"), matching whole model names only."""
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])", name):
            return PEAK_FLOPS[key]
    return None


def device_name(device: torch.device) -> str:
    """What the run trains on, for meta.json: the GPU's model name, or the CPU's."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type}: {platform.processor() or platform.machine()}"


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return peak_flops_of(torch.cuda.get_device_name(device))


def resolve_precision(precision: str, device: torch.device) -> str:
    """'auto' is bf16 on GPUs that support it and fp32 elsewhere."""
    if precision != "auto":
        return precision
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return "bf16"
    return "fp32"


def autocast(precision: str, device: torch.device) -> Callable[[], contextlib.AbstractContextManager[None]]:
    """A factory of the autocast context for one forward pass."""
    if precision == "fp32":
        return contextlib.nullcontext
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)


def memory_gib(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocator peak on a GPU, max resident set on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**30 if sys.platform == "darwin" else rss / 2**20

"""What this machine can do for training: the device, its memory, bf16, attention kernels, NCCL, versions.

Every answer comes from asking torch on this machine (a tiny forward and backward for each attention kernel),
never from a table, so `kubetrain doctor` reports what a run here would really get. The one choice made from
those answers, the precision and whether to compile, are pure functions (`choose_precision`, `choose_compile`)
that the loop, the memory estimate and the doctor share.
"""

from __future__ import annotations

import importlib.metadata
import os
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

# torch's SDPA kernels, in the order torch prefers them when several can run.
SDPA_BACKENDS = ("flash", "memory-efficient", "cudnn", "math")


@dataclass(frozen=True)
class DeviceInfo:
    kind: str  # cuda, rocm, mps or cpu
    name: str
    memory_total: int | None  # bytes
    memory_free: int | None
    count: int  # devices of this kind (CPU: cores)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def device_info(device: torch.device) -> DeviceInfo:
    """The accelerator (or CPU) a run on `device` would use, and its memory free now."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        kind = "rocm" if torch.version.hip else "cuda"
        return DeviceInfo(kind, torch.cuda.get_device_name(device), total, free, torch.cuda.device_count())
    if device.type == "mps":
        total = torch.mps.recommended_max_memory()
        return DeviceInfo("mps", "Apple GPU (Metal)", total, total - torch.mps.current_allocated_memory(), 1)
    host_total, host_free = host_memory()
    limited = container_memory_free()
    if host_free is not None and limited is not None:
        host_free = min(host_free, limited)
    return DeviceInfo("cpu", cpu_name(), host_total, host_free, os.cpu_count() or 1)


def host_memory() -> tuple[int | None, int | None]:
    """(total, available) RAM in bytes, from psutil when installed, else /proc/meminfo."""
    try:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.total), int(vm.available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            info = dict(line.split(":", 1) for line in f)
    except OSError:
        return None, None
    kib = {k: int(v.split()[0]) * 1024 for k, v in info.items() if k in ("MemTotal", "MemAvailable")}
    return kib.get("MemTotal"), kib.get("MemAvailable")


def container_memory_free() -> int | None:
    """Bytes this container's cgroup may still allocate (v2, then v1); None without a limit.

    /proc/meminfo shows the host's memory, so a pod limited to 8 GiB on a 512 GiB node would pass without this.
    """
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit_text = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit_text == "max" or int(limit_text) >= 2**62:  # no limit (v1 writes a huge number)
            return None
        return max(0, int(limit_text) - usage)
    return None


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "cpu"


def bf16_supported(device: torch.device) -> bool:
    """Whether bf16 matmuls run on the device (on CUDA: natively, the fact choose_precision reads)."""
    if device.type == "cuda":
        return accelerator(device).native_bf16
    try:
        a = torch.ones(4, 4, device=device, dtype=torch.bfloat16)
        return bool((a @ a).float().sum().item() == 64.0)
    except (RuntimeError, TypeError):
        return False


@dataclass(frozen=True)
class Accelerator:
    """What the precision choice needs to know about a device, asked of torch once."""

    type: str  # cuda, mps or cpu (ROCm GPUs are "cuda" to torch)
    capability: tuple[int, int] | None = None  # CUDA compute capability (8, 0) = sm80
    native_bf16: bool = False  # bf16 on tensor cores, not emulated through fp32


def accelerator(device: torch.device) -> Accelerator:
    if device.type == "cuda":
        return Accelerator("cuda", tuple(torch.cuda.get_device_capability(device)),  # type: ignore[arg-type]
                           bool(torch.cuda.is_bf16_supported(including_emulation=False)))
    return Accelerator(device.type)


@dataclass(frozen=True)
class Precision:
    name: str  # fp32, bf16 or fp16 (fp16 trains with a loss scaler)
    reason: str
    warning: str | None = None


def choose_precision(requested: str, acc: Accelerator) -> Precision:
    """The precision a run asking for `requested` trains in on `acc`: the one decision the loop and doctor share.

    'auto' follows nanoGPT (train.py) and litgpt (get_default_supported_precision): bf16 where the GPU has it
    natively, else fp16 with a GradScaler. torch.cuda.is_bf16_supported() alone also counts emulation, which
    would put a T4 or V100 (below sm80) on slow emulated bf16 without a flash kernel.
    """
    sm = f"sm{acc.capability[0]}{acc.capability[1]}" if acc.capability else acc.type
    if requested != "auto":
        warning = None
        if requested == "bf16" and acc.type == "cuda" and not acc.native_bf16:
            warning = (f"bf16 is emulated on this GPU ({sm}): slow, and no flash attention; "
                       "precision auto (fp16 with loss scaling) uses its tensor cores")
        return Precision(requested, "as configured", warning)
    if acc.type != "cuda":
        return Precision("fp32", f"auto: no mixed precision on {acc.type}")
    if acc.native_bf16:
        return Precision("bf16", f"auto: native bf16 on this GPU ({sm})")
    return Precision("fp16", f"auto: no native bf16 on this GPU ({sm}): fp16 with loss scaling")


def sdpa_backends(device: torch.device, dtype: torch.dtype, head_dim: int, n_head: int = 2) -> dict[str, str]:
    """Each SDPA kernel -> "ok", or why it cannot run a causal forward+backward of this head size and dtype."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kernels = {"flash": SDPBackend.FLASH_ATTENTION, "memory-efficient": SDPBackend.EFFICIENT_ATTENTION,
               "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
    result: dict[str, str] = {}
    for name in SDPA_BACKENDS:
        q, k, v = (torch.randn(1, n_head, 64, head_dim, device=device, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            try:
                with sdpa_kernel([kernels[name]]):
                    F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
                result[name] = "ok"
            except RuntimeError as e:
                # torch warns with the reason a kernel was skipped (head size, dtype, GPU generation) on CUDA
                reasons = [str(w.message).splitlines()[0] for w in seen if "kernel" in str(w.message).lower()
                           or "requires" in str(w.message).lower()]
                fallback = f"no {device.type} kernel" if "No viable backend" in str(e) else str(e).splitlines()[0]
                result[name] = reasons[0] if reasons else fallback
    return result


def versions() -> dict[str, str | None]:
    """torch, CUDA/ROCm, cuDNN and NCCL versions (None where not built in or not present)."""
    nccl = None
    if torch.cuda.is_available() and torch.distributed.is_nccl_available():
        v = torch.cuda.nccl.version()
        nccl = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "rocm": torch.version.hip,
            "cudnn": str(cudnn) if cudnn else None, "nccl": nccl}


# Inductor's GPU kernels are Triton's, and Triton needs compute capability 7.0 or newer (torch/_inductor and
# torch/_dynamo refuse older devices with "Triton only supports devices of CUDA Capability >= 7.0").
TRITON_MIN_CAPABILITY = (7, 0)


@dataclass(frozen=True)
class CompileChoice:
    """Whether this run compiles, and why (the start-up line says both)."""

    enabled: bool
    why: str

    def line(self) -> str:
        return f"compile: {'on' if self.enabled else 'off'} ({self.why})"


def choose_compile(requested: bool | str, device_type: str, capability: tuple[int, int] | None = None,
                   triton: str | None = "assumed") -> CompileChoice:
    """`train.compile` for a run on `device_type`: true and false as asked; auto on a CUDA (or ROCm) GPU of
    compute capability 7.0+ (V100, T4, A10, A100, L4, L40S, RTX 20xx-50xx, H100, H200, B200, MI200/MI300) with
    Triton installed, and off on the CPU and MPS. Without a GPU at hand (`k8s render` for GPU pods) capability None
    and triton "assumed": the image's CUDA torch brings Triton.

    Measured on an H200 (gpt2-124m, bf16, micro-batch 16): compiled 394.6k tokens/s, eager 284.7k, so a GPU
    compiles by default. On the CPU Inductor builds C++ kernels for minutes (2m43s cold for a 2-layer GPT on a
    2-core VM) and gains little; MPS's Inductor backend is young.
    """
    if requested is True or requested is False:
        return CompileChoice(requested, f"train.compile: {str(requested).lower()}")
    if device_type == "cuda":
        if triton is None:
            return CompileChoice(False, "auto: no Triton here, and Inductor's GPU kernels are Triton's; "
                                        "install triton to compile")
        if capability is not None and capability < TRITON_MIN_CAPABILITY:
            return CompileChoice(False, f"auto: compute capability {capability[0]}.{capability[1]}, Triton "
                                        "needs 7.0 or newer")
        where = f"sm{capability[0]}{capability[1]}" if capability else "a GPU"
        return CompileChoice(True, f"auto: CUDA {where} with Triton {triton}; train.compile: false turns it off")
    if device_type == "mps":
        return CompileChoice(False, "auto: off on MPS, whose Inductor backend is experimental")
    return CompileChoice(False, "auto: off on the CPU, where Inductor builds C++ kernels for minutes and gains "
                                "little; train.compile: true compiles anyway")


def triton_version() -> str | None:
    """The installed Triton's version (ROCm's wheel is pytorch-triton-rocm), or None."""
    for dist in ("triton", "pytorch-triton-rocm", "pytorch-triton"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def compile_choice(requested: bool | str, device: torch.device) -> CompileChoice:
    """`choose_compile` for this process's device."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return choose_compile(requested, device.type, capability, triton_version() if device.type == "cuda" else None)

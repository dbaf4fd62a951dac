"""One rank's device before training: does it compute right, can it hold most of its free memory, and what
does the driver say (ECC errors, retired pages, throttling)? Part of the preflight (distributed/preflight.py)."""

from __future__ import annotations

import shutil
import subprocess
import time
from typing import Any

import torch

# A matmul of random normals checked against float64 on the CPU, as the largest error over the largest value:
# float32 accumulation over n=1024 is ~1e-6; CUDA may use TF32 (10-bit mantissa, ~1e-3). A device that computes
# wrong (a bad SM, bad memory) is off by far more.
MATMUL_TOLERANCE = {"cuda": 1e-2, "cpu": 1e-4}
MATMUL_SIZE = {"cuda": 2048, "cpu": 256}
MEMORY_SHARE = 0.9  # of the free memory on CUDA: most of it, leaving the allocator and the driver room
CPU_MEMORY_BYTES = 64 * 2**20  # on the CPU a bounded check: the workers share the host's memory
CHUNK_BYTES = 2**30
PATTERN = 0x5A5A_A5A5_0F0F_F0F0  # alternating bits in every byte


def device_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The matmul under test (a name of its own: a test replaces it on one rank to make a device compute wrong)."""
    return a @ b


def check_matmul(device: torch.device) -> dict[str, Any]:
    """A seeded matmul on `device` against a float64 CPU reference: the relative error and whether it passes."""
    kind = "cuda" if device.type == "cuda" else "cpu"
    n = MATMUL_SIZE[kind]
    gen = torch.Generator().manual_seed(20_241_129)  # the same inputs on every rank: errors are comparable
    a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    reference = a.double() @ b.double()
    got = device_matmul(a.to(device), b.to(device)).double().cpu()
    error = float((got - reference).abs().max() / reference.abs().max())
    ok = error == error and error <= MATMUL_TOLERANCE[kind]  # NaN fails
    return {"size": n, "relative_error": error, "tolerance": MATMUL_TOLERANCE[kind], "ok": ok}


def check_memory(device: torch.device) -> dict[str, Any]:
    """Allocate most of the free device memory (a bounded block on the CPU), write a pattern, read it back."""
    started = time.perf_counter()
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        target = int(free * MEMORY_SHARE)
    else:
        target = CPU_MEMORY_BYTES
    chunks: list[torch.Tensor] = []
    wrong = 0
    try:
        left = target
        while left > 0:
            size = min(CHUNK_BYTES, left)
            # 64-bit words, a value per chunk: a chunk that aliases another reads wrong
            chunk = torch.empty(size // 8, dtype=torch.int64, device=device)
            chunk.fill_(PATTERN + len(chunks))
            chunks.append(chunk)
            left -= size
        for i, chunk in enumerate(chunks):
            wrong += int(torch.count_nonzero(chunk != PATTERN + i))
    except torch.OutOfMemoryError as e:
        first = (str(e).splitlines() or [""])[0]
        return {"bytes": target, "ok": False, "error": f"out of memory: {first}"[:200]}
    finally:
        del chunks
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
    seconds = time.perf_counter() - started
    return {"bytes": target, "wrong_words": wrong, "seconds": round(seconds, 3), "ok": wrong == 0}


# nvidia-smi's names for what NVML reports; a non-zero value of the first two is a failing device.
SMI_FIELDS = ("ecc.errors.uncorrected.volatile.total", "retired_pages.pending", "clocks_throttle_reasons.active")


def driver_view(device: torch.device) -> dict[str, Any]:
    """The driver's view of this CUDA device: uncorrected ECC errors, pending page retirement, throttle reasons.

    NVML (nvidia-ml-py) where importable, else `nvidia-smi`; neither: skipped with a note, not a failure.
    """
    if device.type != "cuda":
        return {"skipped": f"not a CUDA device ({device.type})", "ok": True}
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        return _nvml_view(index)
    except ImportError:
        pass
    except Exception as e:  # NVML present but failing (no driver library): try the command line
        note = f"NVML: {type(e).__name__}: {e}"
        smi = _smi_view(index)
        return smi if "skipped" not in smi else {"skipped": note, "ok": True}
    return _smi_view(index)


def _nvml_view(index: int) -> dict[str, Any]:
    import pynvml  # nvidia-ml-py; optional

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(_physical_index(index))
        out: dict[str, Any] = {"source": "nvml"}
        try:
            out["ecc_uncorrected"] = int(pynvml.nvmlDeviceGetTotalEccErrors(
                handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC))
        except pynvml.NVMLError:
            out["ecc_uncorrected"] = None  # ECC off or not supported (consumer GPUs)
        try:
            out["retired_pages_pending"] = bool(pynvml.nvmlDeviceGetRetiredPagesPendingStatus(handle))
        except pynvml.NVMLError:
            out["retired_pages_pending"] = None
        reasons = int(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle))
        out["throttle_reasons"] = _throttle_names(reasons, pynvml)
    finally:
        pynvml.nvmlShutdown()
    return _judge_driver(out)


def _throttle_names(mask: int, nvml: Any) -> list[str]:
    """The throttle reasons that mean a slow device (idle and application clocks are normal)."""
    names = {"HwSlowdown": "hardware slowdown", "SwThermalSlowdown": "thermal (software)",
             "HwThermalSlowdown": "thermal (hardware)", "HwPowerBrakeSlowdown": "power brake"}
    found = []
    for attr, name in names.items():
        bit = getattr(nvml, f"nvmlClocksThrottleReason{attr}", None)
        if bit is not None and mask & int(bit):
            found.append(name)
    return found


def _smi_view(index: int) -> dict[str, Any]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {"skipped": "no NVML (nvidia-ml-py) and no nvidia-smi here", "ok": True}
    try:
        proc = subprocess.run([smi, f"--id={_physical_index(index)}", f"--query-gpu={','.join(SMI_FIELDS)}",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"skipped": f"nvidia-smi failed: {e}", "ok": True}
    if proc.returncode != 0:
        return {"skipped": f"nvidia-smi exited {proc.returncode}: {proc.stderr.strip()[:160]}", "ok": True}
    values = [v.strip() for v in proc.stdout.strip().split(",")]
    if len(values) != len(SMI_FIELDS):
        return {"skipped": f"nvidia-smi said {proc.stdout.strip()[:160]!r}", "ok": True}
    ecc, pending, throttle = values
    out: dict[str, Any] = {
        "source": "nvidia-smi",
        "ecc_uncorrected": int(ecc) if ecc.isdigit() else None,  # "[N/A]" without ECC
        "retired_pages_pending": {"Yes": True, "No": False}.get(pending),
        "throttle_reasons": [] if throttle in ("0x0000000000000000", "[N/A]") else [f"mask {throttle}"],
    }
    return _judge_driver(out)


def _judge_driver(view: dict[str, Any]) -> dict[str, Any]:
    """Uncorrected ECC errors or pages waiting for retirement fail the device; throttling is a warning."""
    view["ok"] = not (view.get("ecc_uncorrected") or view.get("retired_pages_pending"))
    return view


def _physical_index(index: int) -> int:
    """NVML and nvidia-smi count every GPU of the host; CUDA_VISIBLE_DEVICES may have renumbered ours."""
    import os

    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if index < len(visible) and visible[index].isdigit():
        return int(visible[index])
    return index


def check_device(device: torch.device) -> dict[str, Any]:
    """The device's three checks; a check that raises fails with its error's first line instead."""
    out: dict[str, Any] = {"device": str(device)}
    if device.type == "cuda":
        out["name"] = torch.cuda.get_device_name(device)
    for name, check in (("matmul", check_matmul), ("memory", check_memory), ("driver", driver_view)):
        try:
            out[name] = check(device)
        except Exception as e:  # a device that errors is a failing device, named with the others
            first = (str(e).strip().splitlines() or [""])[0]
            out[name] = {"ok": False, "error": f"{type(e).__name__}: {first}"[:200]}
    out["ok"] = all(out[name]["ok"] for name in ("matmul", "memory", "driver"))
    return out

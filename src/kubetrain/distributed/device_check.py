"""One rank's device before training: does it compute right, can it hold most of its free memory, and what
does the driver say (ECC errors, retired pages, remapped rows, clock slowdowns)? Part of the preflight
(distributed/preflight.py), which stops a job only on what is certain: a wrong result, an uncorrectable error."""

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


# NVML's clock event reasons that mean a slower device (nvml.h, nvmlClocksThrottleReason* / nvmlClocksEventReason*:
# the bits are the same in both spellings). "HW Slowdown ... reducing the core clocks by a factor of 2 or more": a
# warning, as the driver means it: the device computes right, slower. Idle, application clocks, the software power
# cap (a GPU at its power limit under load) and sync boost are normal operation and not reported.
SLOWDOWN_REASONS = {0x08: "hardware slowdown", 0x20: "thermal (software)", 0x40: "thermal (hardware)",
                    0x80: "power brake"}
# nvidia-smi's names for the same counters, when NVML's Python binding is not installed (row remapping is read
# through NVML only).
SMI_FIELDS = ("ecc.errors.uncorrected.volatile.total", "ecc.errors.uncorrected.aggregate.total",
              "retired_pages.pending", "clocks_throttle_reasons.active")


def driver_view(device: torch.device) -> dict[str, Any]:
    """The driver's view of this CUDA device (ECC counters, page retirement, row remapping, clock slowdowns), judged.

    NVML (nvidia-ml-py) where importable, else `nvidia-smi`; neither: skipped with a note, not a failure.
    """
    if device.type != "cuda":
        return {"skipped": f"not a CUDA device ({device.type})", "ok": True}
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        return judge_driver(_nvml_counters(index))
    except ImportError:
        pass
    except Exception as e:  # NVML present but failing (no driver library): try the command line
        note = f"NVML: {type(e).__name__}: {e}"
        smi = _smi_view(index)
        return smi if "skipped" not in smi else {"skipped": note, "ok": True}
    return _smi_view(index)


def _nvml_counters(index: int) -> dict[str, Any]:
    """The counters as NVML returns them; None where the device does not support one (consumer GPUs have no ECC,
    row remapping is Ampere and later, page retirement is before Ampere)."""
    import pynvml  # nvidia-ml-py; optional

    def read(call: Any, *args: Any) -> Any:
        try:
            return call(*args)
        except pynvml.NVMLError:
            return None

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(_physical_index(index))
        uncorrected = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) \
            or pynvml.nvmlDeviceGetCurrentClocksThrottleReasons  # the older name, deprecated since R535
        return {
            "source": "nvml",
            "ecc_volatile_uncorrected": read(pynvml.nvmlDeviceGetTotalEccErrors, handle, uncorrected,
                                             pynvml.NVML_VOLATILE_ECC),
            "ecc_aggregate_uncorrected": read(pynvml.nvmlDeviceGetTotalEccErrors, handle, uncorrected,
                                              pynvml.NVML_AGGREGATE_ECC),
            "retired_pages_pending": read(pynvml.nvmlDeviceGetRetiredPagesPendingStatus, handle),
            "remapped_rows": read(pynvml.nvmlDeviceGetRemappedRows, handle),
            "clock_event_reasons": read(reasons, handle),
        }
    finally:
        pynvml.nvmlShutdown()


def judge_driver(counters: dict[str, Any]) -> dict[str, Any]:
    """The device's verdict from NVML's counters, read the way NVML means them; `ok` False fails the device.

    - Volatile uncorrected ECC errors count since the driver loaded (each compute app without persistence mode):
      an uncorrectable error in this boot of the device, which may sit in memory the job uses. A failure.
    - Aggregate ones count over the device's lifetime: history, which page retirement or row remapping has dealt
      with. A warning.
    - Row remapping (Ampere and later; remapped_rows is NVML's (correctable, uncorrectable, pending, failure)): a
      past remapping failure leaves a bad row in use, a failure; a pending one needs a GPU reset to take effect,
      and NVML says it "won't affect future work on the GPU since error-containment and dynamic page blacklisting
      will take care of that": a warning.
    - Pages pending retirement (before Ampere): retired only at the next driver reload, in use until then: a failure.
    - Clock slowdowns (SLOWDOWN_REASONS): a warning.
    """
    problems, warnings = [], []
    volatile = counters.get("ecc_volatile_uncorrected")
    if volatile:
        problems.append(f"{volatile} uncorrectable ECC error(s) since the driver loaded")
    aggregate = counters.get("ecc_aggregate_uncorrected")
    if aggregate and not volatile:
        warnings.append(f"{aggregate} uncorrectable ECC error(s) in the device's lifetime (none since the driver "
                        "loaded)")
    if counters.get("retired_pages_pending"):
        problems.append("memory pages pending retirement (a driver reload retires them)")
    remapped = counters.get("remapped_rows")
    if remapped is not None:
        _corrected, _uncorrected, pending, failure = (int(v) for v in remapped)
        if failure:
            problems.append("a row remapping failed (a bad memory row stays in use)")
        elif pending:
            warnings.append("a row remapping is pending (takes effect at the next GPU reset)")
    mask = counters.get("clock_event_reasons")
    slowdowns = [name for bit, name in SLOWDOWN_REASONS.items() if mask and int(mask) & bit]
    if slowdowns:
        warnings.append(f"clocks slowed: {', '.join(slowdowns)}")
    return {**counters, "ok": not problems, "problems": problems, "warnings": warnings}


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
    return judge_driver(smi_counters(proc.stdout))


def smi_counters(line: str) -> dict[str, Any]:
    """nvidia-smi's CSV line of SMI_FIELDS as NVML's counters ("[N/A]" where the device has no such counter)."""
    values = [v.strip() for v in line.strip().split(",")]
    if len(values) != len(SMI_FIELDS):
        return {"source": "nvidia-smi", "unread": line.strip()[:160]}
    volatile, aggregate, retired, reasons = values
    return {"source": "nvidia-smi", "ecc_volatile_uncorrected": int(volatile) if volatile.isdigit() else None,
            "ecc_aggregate_uncorrected": int(aggregate) if aggregate.isdigit() else None,
            "retired_pages_pending": {"Yes": True, "No": False}.get(retired),
            "clock_event_reasons": int(reasons, 16) if reasons.startswith("0x") else None}


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

"""One rank's device check on this machine's CPU: a right matmul passes, a wrong one fails, memory reads back."""

from __future__ import annotations

import pytest
import torch

from kubetrain.distributed import device_check
from kubetrain.distributed.device_check import (
    CPU_MEMORY_BYTES,
    check_device,
    check_matmul,
    check_memory,
    driver_view,
    judge_driver,
    smi_counters,
)

CPU = torch.device("cpu")


def test_a_right_matmul_passes_against_the_float64_reference() -> None:
    found = check_matmul(CPU)
    assert found["ok"] and found["relative_error"] < 1e-5  # float32 over 256 terms


def test_one_wrong_element_fails_the_matmul(monkeypatch: pytest.MonkeyPatch) -> None:
    def corrupt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = a @ b
        out[3, 5] += 0.01 * out.abs().max()  # one lane off by 1% of the largest value
        return out

    monkeypatch.setattr(device_check, "device_matmul", corrupt)
    found = check_matmul(CPU)
    assert not found["ok"] and found["relative_error"] == pytest.approx(0.01, rel=0.05)


def test_memory_is_allocated_written_and_read_back_bounded_on_the_cpu() -> None:
    found = check_memory(CPU)
    assert found == {**found, "ok": True, "wrong_words": 0, "bytes": CPU_MEMORY_BYTES}


def test_the_driver_view_is_skipped_with_a_note_off_cuda() -> None:
    assert driver_view(CPU) == {"skipped": "not a CUDA device (cpu)", "ok": True}


def test_a_check_that_raises_fails_the_device_with_its_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")

    monkeypatch.setattr(device_check, "device_matmul", broken)
    found = check_device(CPU)
    assert not found["ok"] and found["memory"]["ok"]
    assert found["matmul"]["error"] == "RuntimeError: CUDA error: an illegal memory access was encountered"


# NVML-shaped counters (what _nvml_counters reads: nvmlDeviceGetTotalEccErrors per counter type,
# nvmlDeviceGetRemappedRows' (correctable, uncorrectable, pending, failure), the clock event reason mask).
HEALTHY = {"ecc_volatile_uncorrected": 0, "ecc_aggregate_uncorrected": 0, "retired_pages_pending": None,
           "remapped_rows": (0, 0, 0, 0), "clock_event_reasons": 0x1}  # idle: the GPU waits for the check


def test_a_healthy_devices_counters_pass_with_no_warning() -> None:
    assert judge_driver(HEALTHY) == {**HEALTHY, "ok": True, "problems": [], "warnings": []}
    assert judge_driver({})["ok"]  # a consumer GPU: no ECC, no remapping (None everywhere)


def test_an_uncorrectable_error_since_the_driver_loaded_fails_the_device() -> None:
    found = judge_driver({**HEALTHY, "ecc_volatile_uncorrected": 3, "ecc_aggregate_uncorrected": 3})
    assert not found["ok"] and found["problems"] == ["3 uncorrectable ECC error(s) since the driver loaded"]


def test_lifetime_errors_alone_are_history_a_warning() -> None:
    # aggregate counts persist for the device's lifetime (NVML's nvmlEccCounterType_t): dealt with by retirement or
    # remapping; the volatile count (since the driver loaded) is what the job would meet
    found = judge_driver({**HEALTHY, "ecc_aggregate_uncorrected": 12, "remapped_rows": (0, 2, 0, 0)})
    assert found["ok"] and found["warnings"] == [
        "12 uncorrectable ECC error(s) in the device's lifetime (none since the driver loaded)"]


def test_a_failed_row_remapping_fails_and_a_pending_one_warns() -> None:
    failed = judge_driver({**HEALTHY, "remapped_rows": (0, 1, 0, 1)})
    assert not failed["ok"] and failed["problems"] == ["a row remapping failed (a bad memory row stays in use)"]
    # NVML: "A pending remapping won't affect future work on the GPU since error-containment and dynamic page
    # blacklisting will take care of that" (a reset applies it)
    pending = judge_driver({**HEALTHY, "remapped_rows": (0, 1, 1, 0)})
    assert pending["ok"] and pending["warnings"] == ["a row remapping is pending (takes effect at the next GPU reset)"]


def test_pages_pending_retirement_fail_the_device_before_ampere() -> None:
    found = judge_driver({**HEALTHY, "remapped_rows": None, "retired_pages_pending": 1})  # NVML_FEATURE_ENABLED
    assert not found["ok"]


def test_slowdown_reasons_warn_and_normal_clock_reasons_do_not() -> None:
    # nvml.h: 0x08 HW slowdown, 0x40 HW thermal; 0x04 SW power cap (at the power limit under load) is normal
    found = judge_driver({**HEALTHY, "clock_event_reasons": 0x08 | 0x40 | 0x04})
    assert found["ok"] and found["warnings"] == ["clocks slowed: hardware slowdown, thermal (hardware)"]
    assert judge_driver({**HEALTHY, "clock_event_reasons": 0x04 | 0x02})["warnings"] == []


def test_nvidia_smis_line_reads_as_nvmls_counters() -> None:
    counters = smi_counters("0, 4, No, 0x0000000000000020\n")
    assert counters == {"source": "nvidia-smi", "ecc_volatile_uncorrected": 0, "ecc_aggregate_uncorrected": 4,
                        "retired_pages_pending": False, "clock_event_reasons": 0x20}
    assert judge_driver(counters)["warnings"] == [
        "4 uncorrectable ECC error(s) in the device's lifetime (none since the driver loaded)",
        "clocks slowed: thermal (software)"]
    assert smi_counters("[N/A], [N/A], [N/A], [N/A]")["ecc_volatile_uncorrected"] is None  # a GPU without ECC


def test_driver_warnings_reach_the_preflights_verdict() -> None:
    from kubetrain.config.preflight import PreflightConfig
    from kubetrain.distributed.preflight import judge

    def entry(rank: int, driver: dict[str, object]) -> dict[str, object]:
        return {"rank": rank, "pod": None, "node": "gpu-a", "clock_offset_seconds": 0.0, "links": [],
                "all_reduce": {"busbw": 1e9},
                "device": {"device": f"cuda:{rank}", "matmul": {"ok": True}, "memory": {"ok": True},
                           "driver": driver}}

    hot = judge_driver({**HEALTHY, "clock_event_reasons": 0x40})
    verdict = judge({"ranks": [entry(0, judge_driver(HEALTHY)), entry(1, hot)], "links": []}, PreflightConfig())
    assert verdict["ok"] and verdict["warnings"] == ["rank 1 (node gpu-a): device cuda:1: clocks slowed: thermal "
                                                     "(hardware)"]

"""One rank's device check on this machine's CPU: a right matmul passes, a wrong one fails, memory reads back."""

from __future__ import annotations

import pytest
import torch

from kubetrain.distributed import device_check
from kubetrain.distributed.device_check import CPU_MEMORY_BYTES, check_device, check_matmul, check_memory, driver_view

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

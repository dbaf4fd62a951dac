"""Device facts: the peak-FLOPS table matches whole model names, never a prefix of another model's."""

from __future__ import annotations

import pytest

from kubetrain.train.device import peak_flops_of


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989e12),
    ("NVIDIA H100 PCIe", 989e12),
    ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA L4", 121e12),
    ("NVIDIA L40", 181e12),  # a substring match gave an L40 the L4's number
    ("NVIDIA L40S", 362e12),
    ("NVIDIA A10", 125e12),
    ("NVIDIA A10G", None),  # ... and an A10G the A10's (it has no published dense peak)
    ("NVIDIA GeForce RTX 3090", 71e12),
    ("AMD Instinct MI300X", 1307e12),
    ("NVIDIA GeForce RTX 3080", None),
    ("NVIDIA T400", None),
])
def test_peak_flops_by_exact_model(name: str, peak: float | None) -> None:
    assert peak_flops_of(name) == peak

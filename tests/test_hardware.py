"""Machine facts asked of torch for real on this machine (the CPU here; a GPU where there is one)."""

from __future__ import annotations

import torch

from kubetrain import hardware


def test_sdpa_probe_runs_each_kernel_for_real() -> None:
    device = torch.device("cpu")
    for dtype, head_dim in ((torch.float32, 16), (torch.bfloat16, 64)):
        found = hardware.sdpa_backends(device, dtype, head_dim)
        assert list(found) == list(hardware.SDPA_BACKENDS)
        assert found["math"] == "ok"  # the reference kernel runs everywhere
        # torch has no memory-efficient or cuDNN kernel on the CPU; the reason is one short line
        assert found["memory-efficient"] == found["cudnn"] == "no cpu kernel"
        assert all(why == "ok" or (why and "\n" not in why) for why in found.values())


def test_the_cpu_is_reported_with_its_memory() -> None:
    info = hardware.device_info(torch.device("cpu"))
    assert info.kind == "cpu" and info.name and info.count >= 1
    assert info.memory_total is not None and info.memory_free is not None
    assert 0 < info.memory_free <= info.memory_total
    assert isinstance(hardware.bf16_supported(torch.device("cpu")), bool)


def test_versions_name_torch_and_say_what_is_absent() -> None:
    v = hardware.versions()
    assert v["torch"] == torch.__version__
    assert v["cuda"] == torch.version.cuda
    if not torch.cuda.is_available():
        assert v["nccl"] is None

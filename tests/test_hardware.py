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


# --- the precision choice: pure, so every GPU generation is tested here -----------------------------------------

T4 = hardware.Accelerator("cuda", (7, 5), native_bf16=False)
V100 = hardware.Accelerator("cuda", (7, 0), native_bf16=False)
A100 = hardware.Accelerator("cuda", (8, 0), native_bf16=True)
H100 = hardware.Accelerator("cuda", (9, 0), native_bf16=True)


def test_auto_is_native_bf16_else_fp16_on_gpus_and_fp32_elsewhere() -> None:
    assert hardware.choose_precision("auto", A100).name == "bf16"
    assert hardware.choose_precision("auto", H100).name == "bf16"
    for old in (T4, V100):  # torch's is_bf16_supported() would say yes (emulation): slow, no flash kernel
        choice = hardware.choose_precision("auto", old)
        assert choice.name == "fp16" and "loss scaling" in choice.reason and choice.warning is None
    assert "sm75" in hardware.choose_precision("auto", T4).reason
    assert hardware.choose_precision("auto", hardware.Accelerator("cpu")).name == "fp32"
    assert hardware.choose_precision("auto", hardware.Accelerator("mps")).name == "fp32"


def test_an_explicit_precision_is_kept_and_emulated_bf16_is_warned_about() -> None:
    assert hardware.choose_precision("fp32", H100) == hardware.Precision("fp32", "as configured")
    emulated = hardware.choose_precision("bf16", T4)
    assert emulated.name == "bf16" and emulated.warning and "emulated" in emulated.warning
    assert hardware.choose_precision("bf16", A100).warning is None
    assert hardware.choose_precision("bf16", hardware.Accelerator("cpu")).warning is None  # CPU bf16 is not CUDA's


def test_this_machines_accelerator_feeds_the_same_choice() -> None:
    acc = hardware.accelerator(torch.device("cpu"))
    assert acc == hardware.Accelerator("cpu")
    assert hardware.choose_precision("auto", acc).name == "fp32"


def test_compile_is_on_by_default_for_gpus_that_triton_serves_and_off_elsewhere() -> None:
    from kubetrain.hardware import choose_compile

    h200 = choose_compile("auto", "cuda", (9, 0), "3.5.0")
    assert h200.enabled and h200.line() == ("compile: on (auto: CUDA sm90 with Triton 3.5.0; train.compile: false "
                                            "turns it off)")
    assert choose_compile("auto", "cuda", (7, 5), "3.5.0").enabled  # a T4
    assert not choose_compile("auto", "cuda", (6, 1), "3.5.0").enabled  # a GTX 1080: Triton needs 7.0
    assert not choose_compile("auto", "cuda", (9, 0), None).enabled  # no Triton installed
    assert choose_compile("auto", "cuda").enabled  # a GPU pod planned from here: the image brings Triton
    assert not choose_compile("auto", "cpu").enabled and not choose_compile("auto", "mps").enabled
    assert choose_compile(True, "cpu").enabled and not choose_compile(False, "cuda", (9, 0), "3.5.0").enabled
    assert "on the CPU" in choose_compile("auto", "cpu").why

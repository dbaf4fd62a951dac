"""Device choices, each a pure function tested on the CPU: peaks, FLOPs, determinism, TF32, device checks, memory."""

from __future__ import annotations

import resource
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kubetrain.config import load_config
from kubetrain.distributed.parallelize import precision_plan
from kubetrain.errors import UserInputError
from kubetrain.models import build_model
from kubetrain.models.lora import apply_lora
from kubetrain.train import device
from kubetrain.train.device import peak_flops_of


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989e12),  # SXM
    ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H200", 989e12),
    ("NVIDIA H200 NVL", 835e12),
    ("NVIDIA B200", 2250e12),
    ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA L4", 121e12),
    ("NVIDIA L40", 181e12),  # a substring match gave an L40 the L4's number
    ("NVIDIA L40S", 362e12),
    ("NVIDIA A10", 125e12),
    ("NVIDIA A10G", None),  # ... and an A10G the A10's (it has no published dense peak)
    ("NVIDIA GeForce RTX 3090", 71e12),
    ("AMD Instinct MI300X", 1307e12),
    ("AMD Instinct MI250X", 191.5e12),  # per GCD: torch sees each die as a device
    ("NVIDIA GeForce RTX 3080", None),
    ("NVIDIA T400", None),
])
def test_peak_flops_by_exact_model(name: str, peak: float | None) -> None:
    assert peak_flops_of(name) == peak
    assert peak_flops_of(name, "fp16") == peak


def test_fp32_runs_are_measured_against_the_tf32_or_the_fp32_peak() -> None:
    assert peak_flops_of("NVIDIA H100 80GB HBM3", "fp32", tf32=True) == 494e12
    assert peak_flops_of("NVIDIA H100 80GB HBM3", "fp32", tf32=False) == 67e12
    assert peak_flops_of("NVIDIA A100-SXM4-40GB", "fp32") == 156e12
    assert peak_flops_of("Tesla T4", "fp32", tf32=True) == 8.1e12  # no TF32 before Ampere
    assert peak_flops_of("NVIDIA T400", "fp32") is None
    assert device.peak_flops(torch.device("cpu"), "fp32") is None


def test_frozen_weights_get_no_weight_gradient_flops() -> None:
    full = device.training_flops_per_token(1000, 1000, 2, 16, 8)
    assert full == 6 * 1000 + 12 * 2 * 16 * 8  # nanoGPT's 6N + 12LHQT
    assert device.training_flops_per_token(1000, 0, 2, 16, 8) == 4 * 1000 + 12 * 2 * 16 * 8


def test_model_flops_count_every_matmul_once_and_lora_less() -> None:
    cfg = load_config(overrides=["model.n_layer=2", "model.n_embd=64", "model.n_head=4", "model.block_size=32"])
    gpt = build_model(cfg.model, 256)
    total, trainable = device.matmul_params(gpt)
    assert total == trainable
    # our GPT's own count (6 x non-embedding params + the tied head) differs only by the norms' weights
    norms = sum(p.numel() for n, p in gpt.named_parameters() if p.dim() == 1)
    assert 6 * total + 12 * 2 * 64 * 32 == gpt.flops_per_token() - 6 * norms
    assert device.depth_and_width(gpt) == (2, 64)
    full = device.model_flops_per_token(gpt, 32)

    lora_cfg = load_config(overrides=["model.n_layer=2", "model.n_embd=64", "model.n_head=4", "model.block_size=32",
                                      "model.lora.r=4"])
    assert lora_cfg.model.lora is not None
    lora = apply_lora(build_model(lora_cfg.model, 256), lora_cfg.model.lora)
    all_lora, adapters = device.matmul_params(lora)
    assert adapters == sum(p.numel() for p in lora.parameters() if p.requires_grad) and 0 < adapters < total
    assert all_lora == total + adapters
    assert device.depth_and_width(lora) == (2, 64)
    counted = device.model_flops_per_token(lora, 32)
    assert counted == 4 * all_lora + 2 * adapters + 12 * 2 * 64 * 32
    assert counted < full * 0.75  # the old 6N count overstated LoRA by up to 1.5x


def test_deterministic_by_default_on_the_cpu_and_only_when_asked_on_cuda() -> None:
    assert device.deterministic_for(None, "cpu") is True
    assert device.deterministic_for(None, "cuda") is False
    assert device.deterministic_for(True, "cuda") is True
    assert device.deterministic_for(False, "cpu") is False


def test_torch_settings_per_device() -> None:
    cfg = load_config()
    cpu = device.torch_settings(cfg, "cpu")
    assert (cpu.deterministic, cpu.tf32, cpu.env, cpu.fill_uninitialized_memory) == (True, False, {}, True)
    gpu = device.torch_settings(cfg, "cuda")
    assert (gpu.deterministic, gpu.tf32, gpu.env) == (False, True, {})
    asked = device.torch_settings(load_config(overrides=["train.deterministic=true", "train.tf32=false"]), "cuda")
    # torchtitan's set_determinism: a fixed cuBLAS workspace, and no NaN fill of every torch.empty
    assert asked.deterministic and not asked.tf32 and not asked.fill_uninitialized_memory
    assert asked.env == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


@pytest.fixture
def restore_torch() -> Iterator[None]:
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.utils.deterministic.fill_uninitialized_memory, warnings.filters[:])  # type: ignore[attr-defined]
    yield
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    torch.utils.deterministic.fill_uninitialized_memory = saved[2]  # type: ignore[attr-defined]
    warnings.filters[:] = saved[3]


def test_a_kernel_without_a_deterministic_version_is_named_once(restore_torch: None) -> None:
    device.apply_torch_settings(load_config(overrides=["run.device=cpu"]), torch.device("cpu"))
    assert torch.are_deterministic_algorithms_enabled()
    t = torch.zeros(4)
    with warnings.catch_warnings(record=True) as seen:
        for _ in range(3):  # put_ without accumulate has no deterministic version, on the CPU too
            t.put_(torch.tensor([0, 1]), torch.tensor([1.0, 2.0]))
        t.put_(torch.tensor([2]), torch.tensor([3.0]))
    named = [str(w.message) for w in seen if "deterministic implementation" in str(w.message)]
    assert len(named) <= 1 and all(m.startswith("put_ ") for m in named)  # once (none if already said here)
    device.apply_torch_settings(load_config(overrides=["run.device=cpu", "train.deterministic=false"]),
                                torch.device("cpu"))
    assert not torch.are_deterministic_algorithms_enabled()


def test_a_device_this_torch_cannot_give_is_one_line() -> None:
    assert device.device_request_problem("auto", False, False, "2.5.0+cpu") is None
    assert device.device_request_problem("cuda", True, True, "2.5.0") is None
    msg = device.device_request_problem("cuda", False, False, "2.5.0+cpu")
    assert msg and "CPU-only build" in msg and "\n" not in msg
    assert "no visible GPU" in (device.device_request_problem("cuda", False, True, "2.5.0") or "")
    if not torch.cuda.is_available():
        with pytest.raises(UserInputError, match=r"run\.device is 'cuda'"):
            device.select_device("cuda")
    assert device.select_device("cpu") == torch.device("cpu")


def test_more_processes_than_gpus_is_refused() -> None:
    assert device.process_count_problem(8, "cuda", 8) is None
    assert device.process_count_problem(4, "cpu", 0) is None  # CPU processes share the cores
    msg = device.process_count_problem(2, "cuda", 1)
    assert msg and "--nproc 2 is more than the 1 GPU(s)" in msg and "\n" not in msg
    device.check_process_count("cpu", 4)
    if not torch.cuda.is_available():
        with pytest.raises(UserInputError, match="CPU-only build"):  # the first thing wrong is said
            device.check_process_count("cuda", 2)


def test_memory_peak_is_the_peak_since_the_last_reading() -> None:
    if not Path("/proc/self/statm").exists():
        pytest.skip("no /proc/self/statm on this system")
    peak = device.MemoryPeak(torch.device("cpu"))
    peak.read_and_reset()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    big = torch.ones(256 * 2**20, dtype=torch.uint8)  # 256 MiB, touched
    peak.sample()
    del big
    with_big = peak.read_and_reset()
    without = peak.read_and_reset()
    assert with_big - without > 0.2  # GiB: the 256 MiB no longer counts once read
    # the kernel's high-water mark is left alone: getrusage (and `time -f %M`) still see the peak
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >= before


def test_a_frozen_hugging_face_base_loads_in_the_training_precision() -> None:
    """Under FSDP/HSDP too: each process loads its shards of the base in that dtype (the policy gathers in it)."""
    hf = ["model.kind=hf", "model.name_or_path=/models/x"]
    lora = load_config(overrides=[*hf, "model.lora.r=4"])
    assert device.hf_weight_dtype(lora, "bf16") == "bfloat16"
    assert device.hf_weight_dtype(lora, "fp16") == "float16"
    assert device.hf_weight_dtype(lora, "fp32") == "float32"
    full = load_config(overrides=hf)
    assert device.hf_weight_dtype(full, "bf16") == "float32"  # AdamW wants fp32 weights
    head = load_config(overrides=[*hf, "model.lora.r=4", 'model.lora.modules_to_save=["lm_head"]'])
    assert device.hf_weight_dtype(head, "bf16") == "float32"
    asked = load_config(overrides=[*hf, "model.dtype=float16"])
    assert device.hf_weight_dtype(asked, "fp32") == "float16"
    assert device.hf_weight_dtype(load_config(), "bf16") == "float32"  # our GPT: fp32


@pytest.mark.parametrize(("precision", "sharded", "autocast", "gathered", "reduced"), [
    ("fp32", False, None, None, None),
    ("fp32", True, None, None, None),
    ("bf16", False, torch.bfloat16, None, None),
    ("fp16", False, torch.float16, None, None),
    ("bf16", True, None, torch.bfloat16, torch.float32),  # torchtitan: no autocast under FSDP's policy
    ("fp16", True, None, torch.float16, torch.float32),  # fp16 gathers in fp16 (the scaler still applies)
])
def test_precision_plan_autocasts_only_without_sharding(precision: str, sharded: bool, autocast: Any,
                                                         gathered: Any, reduced: Any) -> None:
    plan = precision_plan(precision, sharded)
    assert (plan.autocast, plan.param_dtype, plan.reduce_dtype) == (autocast, gathered, reduced)
    with device.autocast(precision, torch.device("cpu"), sharded)():
        assert torch.is_autocast_enabled("cpu") == (autocast is not None)


def test_a_lora_run_trains_on_a_bf16_base_with_fp32_adapters(
    make_lora_config: Any, llama_dir: Path, chat_file: Path, tmp_path: Path
) -> None:
    from kubetrain.train.trainer import RunOptions, Trainer

    cfg = make_lora_config(tmp_path, llama_dir, chat_file, train__precision="bf16", train__max_steps=2,
                           eval__every_steps=2, checkpoint__every_steps=2)
    trainer = Trainer(cfg, RunOptions(argv=[]), log=lambda m: None)
    result = trainer.run()
    frozen = {p.dtype for p in trainer.base.parameters() if not p.requires_grad}
    trained = {p.dtype for p in trainer.base.parameters() if p.requires_grad}
    assert frozen == {torch.bfloat16} and trained == {torch.float32}
    assert result.status == "finished" and result.final_train_loss is not None

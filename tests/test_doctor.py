"""`kubetrain doctor`: the report, the memory estimate and the settings a run would pick."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kubetrain import doctor
from kubetrain.config import load_config
from kubetrain.memory import LAUNCHER_RUNTIME, Layout, model_shape


def test_report_without_a_config_describes_the_machine_only() -> None:
    report = doctor.doctor(None)
    assert set(report) == {"device", "bf16", "precision", "sdpa", "versions", "disk", "extras"}
    assert report["sdpa"]["backends"]["math"] == "ok"
    assert report["disk"]["free"] > 0
    assert {"hf", "export", "k8s", "track"} <= set(report["extras"])
    text = doctor.render(report)
    assert text.startswith("device: ") and "attention kernels (SDPA" in text and "a run here" not in text


def test_report_with_a_config_estimates_the_fit_and_names_the_settings(tmp_path: Path) -> None:
    cfg = load_config(overrides=[f"run.output_dir={tmp_path / 'runs'}", "run.device=cpu", "run.threads=1"])
    report = doctor.doctor(cfg)
    assert report["sdpa"]["head_dim"] == cfg.model.n_embd // cfg.model.n_head
    s = report["settings"]
    assert (s["device"], s["precision"], s["dist_backend"], s["threads"]) == ("cpu", "fp32", "gloo", 1)
    assert s["attention"] in ("flash", "math")
    assert (s["deterministic"], s["tf32"], s["peak_flops"]) == (True, False, None)  # on the CPU: exact, no MFU
    assert report["precision"] == {"name": "fp32", "reason": "auto: no mixed precision on cpu", "warning": None}
    assert "precision: fp32 (auto: no mixed precision on cpu)" in doctor.render(report)
    assert s["tokens_per_step"] == cfg.train.micro_batch_size * cfg.model.block_size
    fit = report["fit"]
    assert fit["fits"] is True and fit["estimate"] == sum(fit["parts"].values())
    assert fit["params"] == sum(p.numel() for p in _tiny_model(cfg).parameters())
    assert "memory (an estimate): " in doctor.render(report)
    assert report["disk"]["path"] == str(tmp_path / "runs")  # not created yet: its file system is asked


def test_tokens_per_step_counts_every_process_as_the_run_does(tmp_path: Path) -> None:
    """`doctor --nproc 2` reports the run's figure: each process trains its own micro-batches."""
    cfg = load_config(overrides=[f"run.output_dir={tmp_path / 'runs'}", "run.device=cpu", "run.threads=1"])
    one = doctor.doctor(cfg)["settings"]
    two = doctor.doctor(cfg, Layout.of(cfg, 2, 2))["settings"]
    assert two["grad_accum_steps"] == one["grad_accum_steps"]  # a fixed micro-batch: the world adds tokens
    assert two["tokens_per_step"] == 2 * one["tokens_per_step"] == 2 * (
        cfg.train.micro_batch_size * cfg.train.grad_accum_steps * cfg.model.block_size)


def _tiny_model(cfg: object) -> torch.nn.Module:
    from kubetrain.models import build_model

    return build_model(cfg.model, 256)  # type: ignore[attr-defined]


def test_the_fit_line_names_the_layout_and_the_node_s_total() -> None:
    cfg = load_config(overrides=["model.n_layer=12", "model.n_embd=768", "model.n_head=12", "dist.strategy=fsdp"])
    fit = doctor.fit_estimate(cfg, model_shape(cfg), "fp32", "flash", 2**40, Layout.of(cfg, 8, 4))
    assert (fit["world_size"], fit["local_processes"], fit["strategy"], fit["shards"]) == (8, 4, "fsdp", 8)
    # the CPU's RAM: 4 processes share it, beside their launcher (each stages its own shards of a checkpoint)
    assert fit["device_need"] == 4 * fit["estimate"] + LAUNCHER_RUNTIME and fit["fits"] is True
    line = doctor._fit_line(fit)
    assert "each of 8 processes (fsdp, sharded 8 ways)" in line and "4 processes on this node need" in line
    on_gpu = doctor.fit_estimate(cfg, model_shape(cfg), "fp32", "flash", fit["estimate"], Layout.of(cfg, 8, 4),
                                 "cuda")
    assert on_gpu["device_need"] == on_gpu["estimate"] and on_gpu["fits"] is True  # a GPU each
    assert "on this node need" not in doctor._fit_line(on_gpu)


def test_a_cuda_device_on_a_torch_without_cuda_is_bad_input(tmp_path: Path) -> None:
    from kubetrain.errors import UserInputError

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    cfg = load_config(overrides=["run.device=cuda"])
    with pytest.raises(UserInputError, match=r"run\.device is 'cuda' but this torch"):
        doctor.doctor(cfg)

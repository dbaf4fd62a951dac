"""`kubetrain doctor`: the report, the memory estimate and the settings a run would pick."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kubetrain import doctor
from kubetrain.config import load_config


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


def _tiny_model(cfg: object) -> torch.nn.Module:
    from kubetrain.models import build_model

    return build_model(cfg.model, 256)  # type: ignore[attr-defined]


def test_the_estimate_follows_the_config() -> None:
    def estimate(*overrides: str, attention: str | None = "flash", free: int | None = 2**40) -> dict[str, object]:
        cfg = load_config(overrides=list(overrides))
        return doctor.fit_estimate(cfg, doctor.model_shape(cfg), "fp32", attention, free)

    base = estimate()
    assert estimate("train.micro_batch_size=32")["parts"]["activations"] == 2 * base["parts"]["activations"]
    assert estimate(attention="math")["parts"]["activations"] > base["parts"]["activations"]
    ckpt = estimate("model.gradient_checkpointing=true")
    assert ckpt["parts"]["activations"] < base["parts"]["activations"]
    assert estimate("model.lora.r=4")["parts"]["optimizer"] == 0
    huge = estimate("model.n_layer=48", "model.n_embd=8192", "model.n_head=64", free=16 * 2**30)
    assert huge["fits"] is False and huge["params"] > 30e9
    assert estimate(free=None)["fits"] is None


def test_a_tokenizer_whose_vocabulary_is_not_known_yet_is_said_so() -> None:
    cfg = load_config(overrides=["data.tokenizer.kind=hf", "data.tokenizer.path=/nonexistent/tok"])
    fit = doctor.fit_estimate(cfg, doctor.model_shape(cfg), "fp32", "flash", 2**30)
    assert fit["estimate"] is None and "set model.vocab_size" in fit["reason"]


def test_a_hugging_face_model_is_measured_from_its_config(llama_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    cfg = load_config(overrides=["model.kind=hf", f"model.name_or_path={llama_dir}"])
    shape = doctor.model_shape(cfg)
    real = AutoModelForCausalLM.from_pretrained(str(llama_dir))
    assert shape["params"] == sum(p.numel() for p in real.parameters())
    assert (shape["n_layer"], shape["hidden"], shape["head_dim"], shape["vocab"]) == (2, 32, 8, 352)


@pytest.mark.parametrize("missing", ["/nonexistent/model"])
def test_a_hugging_face_model_that_is_not_here(missing: str) -> None:
    cfg = load_config(overrides=["model.kind=hf", f"model.name_or_path={missing}"])
    assert "no config.json" in doctor.model_shape(cfg)["error"]


def test_the_estimate_knows_fsdp_and_the_world_size() -> None:
    cfg = load_config(overrides=["model.n_layer=12", "model.n_embd=768", "model.n_head=12", "dist.strategy=fsdp"])
    shape = doctor.model_shape(cfg)

    def parts(world: int, config: object = cfg, precision: str = "fp32") -> dict[str, int]:
        return doctor.estimate_memory(config, shape, world, precision=precision, attention="flash")  # type: ignore[arg-type]

    one, four, eight = parts(1), parts(4), parts(8)
    assert "gathered" not in one and "ddp_buckets" not in one  # one process: the strategy plays no part
    assert four["weights"] == -(-one["weights"] // 4) and four["optimizer"] == -(-one["optimizer"] // 4)
    block = (shape["params"] - shape["vocab"] * shape["hidden"]) // 12  # the tied head is the embedding
    assert four["gathered"] == (shape["vocab"] * shape["hidden"] + 2 * block) * 4 + block * 4
    assert four["activations"] == one["activations"]  # a micro-batch is per process whatever the world
    assert sum(eight.values()) < sum(four.values()) < sum(one.values())
    ddp = parts(4, load_config(overrides=["model.n_layer=12", "model.n_embd=768", "model.n_head=12"]))
    assert ddp["ddp_buckets"] == ddp["gradients"] and sum(ddp.values()) > sum(one.values())
    assert parts(4, precision="bf16")["gathered"] < four["gathered"]  # bf16 all-gathers move half the bytes

    checkpointed = load_config(overrides=["model.n_layer=12", "model.n_embd=768", "model.n_head=12",
                                          "dist.strategy=fsdp", "model.gradient_checkpointing=true"])
    assert parts(4, checkpointed)["activations"] < four["activations"] / 4

    fit = doctor.fit_estimate(cfg, shape, "fp32", "flash", 2**40, world_size=4)
    assert (fit["world_size"], fit["strategy"], fit["estimate"]) == (4, "fsdp", sum(four.values()))
    assert "each of 4 processes (fsdp)" in doctor._fit_line(fit)
def test_a_cuda_device_on_a_torch_without_cuda_is_bad_input(tmp_path: Path) -> None:
    from kubetrain.errors import UserInputError

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    cfg = load_config(overrides=["run.device=cuda"])
    with pytest.raises(UserInputError, match=r"run\.device is 'cuda' but this torch"):
        doctor.doctor(cfg)

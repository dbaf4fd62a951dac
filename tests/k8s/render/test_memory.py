"""A pod memory request that cannot hold what its processes keep in host memory is one line at render."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kubetrain.config import load_config
from kubetrain.config.schema import Config
from kubetrain.k8s.render.context import RenderError
from kubetrain.k8s.render.manifest import pod_templates, render
from kubetrain.k8s.render.memory import GIB, host_need, pod_estimate, size
from kubetrain.memory import LAUNCHER_RUNTIME, RUNTIME, model_shape

Cli = Callable[..., tuple[int, str, str]]
# GPT-2 small's shape at micro-batch 16: about 19.4 GiB per process on the CPU, runtime included (doctor)
GPT2 = ["model.n_layer=12", "model.n_head=12", "model.n_embd=768", "model.block_size=1024",
        "model.vocab_size=50304", "data.tokenizer.kind=bpe", "data.tokenizer.vocab_size=50304",
        "train.micro_batch_size=16"]


def gpt2(*overrides: str) -> Config:
    return load_config(None, "tiny", [*GPT2, *overrides])


def test_a_cpu_pod_holds_every_process_s_training_state() -> None:
    cfg = gpt2("k8s.resources.memory=28Gi")
    shape = model_shape(cfg)
    one = pod_estimate(cfg, shape)
    state = one.per_process - one.parts["runtime"] - one.parts["allocator"]
    named = ("weights", "gradients", "optimizer", "activations", "loss", "data", "checkpoint_staging")
    assert state == sum(one.parts[name] for name in named)  # every part of the training state is in the pod's need
    # the head fused with the loss (eager on the CPU): a tenth of one fp32 copy of the whole logits at most
    assert one.parts["loss"] < 16 * 1024 * 50304 * 4 / 10
    assert host_need(cfg, shape)[0] == one.per_process + LAUNCHER_RUNTIME  # the process and its launcher
    render(cfg)  # one process (and its launcher) fits in 28Gi

    two = gpt2("k8s.resources.memory=28Gi", "k8s.nproc_per_node=2")
    each = pod_estimate(two, shape)
    both = 2 * each.per_process - each.parts["checkpoint_staging"] + LAUNCHER_RUNTIME  # rank 0 alone stages
    with pytest.raises(RenderError) as refused:
        render(two)
    assert str(refused.value) == (
        f"k8s.resources.memory (28Gi) cannot hold what a pod's processes need: about {both / GIB:.1f} GiB "
        f"(2 x up to {each.per_process / GIB:.1f} GiB on the CPU: training state and runtime; the launcher's "
        f"{size(LAUNCHER_RUNTIME)}; `kubetrain doctor CONFIG` shows the estimate); "
        "raise k8s.resources.memory; run fewer processes per pod (k8s.nproc_per_node 2); lower train.micro_batch_size "
        "(raise train.grad_accum_steps to keep the batch) or model.block_size, or set "
        "model.gradient_checkpointing=true, or set run.check_memory=false to render anyway")
    render(gpt2("k8s.resources.memory=28Gi", "k8s.nproc_per_node=2", "train.micro_batch_size=4"))  # what it says
    render(gpt2("k8s.resources.memory=28Gi", "k8s.nproc_per_node=2", "run.check_memory=false"))  # the opt-out


def test_a_gpu_pod_holds_the_host_copies_of_the_weights_only() -> None:
    # the training state lives on the GPUs: 16Gi of host memory is plenty for 124M parameters x 4 processes
    render(gpt2("k8s.resources.gpu=4", "k8s.nproc_per_node=4"))
    # ~1.65B parameters: 6.1 GiB of fp32 weights, which each of 4 processes builds on the CPU before moving it
    big = ["model.n_layer=24", "model.n_head=16", "model.n_embd=2304", "k8s.resources.gpu=4",
           "k8s.nproc_per_node=4", "k8s.resources.memory=20Gi"]
    cfg = gpt2(*big)
    weights = model_shape(cfg)["params"] * 4
    with pytest.raises(RenderError) as refused:
        render(cfg)
    staged = weights + model_shape(cfg)["params"] * 8  # rank 0's background copy of the weights and AdamW's moments
    need = 4 * weights + 4 * RUNTIME + LAUNCHER_RUNTIME + staged
    assert f"about {need / GIB:.1f} GiB (4 x {weights / GIB:.1f} GiB of weights in host memory" in str(
        refused.value)
    assert "build the model sharded with dist.strategy=fsdp" in str(refused.value)
    # built on the meta device: only rank 0 gathers a copy, to save; no background copy of the shards to the host
    render(gpt2(*big, "dist.strategy=fsdp", "checkpoint.async_save=false"))
    render(gpt2(*big, "run.check_memory=false"))


def test_a_hugging_face_model_is_counted_from_its_config_json(llama_dir: Path) -> None:
    hf = ["model.kind=hf", f"model.name_or_path={llama_dir}", "model.dtype=bfloat16", "data.tokenizer.kind=hf",
          f"data.tokenizer.path={llama_dir}", "k8s.resources.gpu=2", "k8s.nproc_per_node=2"]
    shape = model_shape(load_config(None, "tiny", hf))
    weights = shape["params"] * 2  # bf16 on the host, as from_pretrained loads it
    with pytest.raises(RenderError) as refused:
        render(load_config(None, "tiny", [*hf, "k8s.resources.memory=1Ki"]))
    need = host_need(load_config(None, "tiny", hf), shape)[0]
    assert need > 2 * weights + 2 * RUNTIME + LAUNCHER_RUNTIME  # the runtimes, with transformers' imports
    assert f"about {size(need)} (2 x {size(weights)} of weights in host memory" in str(refused.value)
    render(load_config(None, "tiny", [*hf, f"k8s.resources.memory={-(-need // 1024)}Ki"]))  # just enough


def test_a_model_of_unknown_size_renders() -> None:
    # a Hugging Face folder only the pods mount: nothing to estimate here, so nothing is refused
    cfg = load_config(None, "tiny", ["model.kind=hf", "model.name_or_path=/models/not-here",
                                     "k8s.resources.memory=1Mi"])
    assert "params" not in model_shape(cfg)  # the size is unknown here (what the 1Mi pod is rendered despite)
    pods = [c for obj in render(cfg) for _, tpl in pod_templates(obj) for c in tpl["spec"]["containers"]]
    assert [c["resources"]["requests"]["memory"] for c in pods] == ["1Mi"]


def test_render_refuses_in_one_line(cli: Cli) -> None:
    code, out, err = cli("k8s", "render", *[a for o in GPT2 for a in ("--set", o)])
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: k8s.resources.memory (16Gi) cannot hold")

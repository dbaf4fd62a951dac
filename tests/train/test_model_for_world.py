"""The model as one process trains it: built whole with GPT(cfg)'s init, LoRA added, parallelism applied once.

The sharded paths (meta device, FSDP/HSDP, shard-only init, LoRA loaded shard by shard) run at 4 gloo ranks in
tests/distributed/test_parallelize.py."""

from __future__ import annotations

import torch

from kubetrain.config.loading import validate
from kubetrain.distributed.env import ProcessEnv
from kubetrain.models import build_model
from kubetrain.models.lora import is_lora
from kubetrain.train.model_for_world import build_model_for_world

MODEL = {"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 16}


def test_one_process_build_is_gpt_init_with_the_weights_names() -> None:
    cfg = validate({"model": {**MODEL, "gradient_checkpointing": True}})
    torch.manual_seed(3)
    model = build_model_for_world(cfg, 64, torch.device("cpu"), "fp32", ProcessEnv())
    torch.manual_seed(3)
    plain = build_model(validate({"model": MODEL}).model, 64)
    assert list(model.state_dict()) == list(plain.state_dict())  # hooks, not wrappers
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), plain.state_dict().values(),
                                                 strict=True))


def test_lora_is_added_before_parallelism() -> None:
    cfg = validate({"model": {**MODEL, "lora": {"r": 2, "target_modules": ["q_proj"]}}})
    model = build_model_for_world(cfg, 64, torch.device("cpu"), "fp32", ProcessEnv())
    assert is_lora(model)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        f"base_model.model.blocks.{i}.attn.q_proj.lora_{ab}.default.weight" for i in range(2) for ab in "AB"}

"""The model as one process trains it: activation checkpointing applied from outside, names unchanged.

The sharded path (meta device, FSDP, materialise) runs with several processes in
tests/distributed/test_parallelize.py."""

from __future__ import annotations

import torch
from torch.distributed._composable import checkpoint

from kubetrain.config.loading import validate
from kubetrain.models import build_model
from kubetrain.train.model_for_world import build_model_for_world, checkpoint_activations

MODEL = {"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 16}


def test_one_process_build_checkpoints_every_block_and_keeps_the_weights_names() -> None:
    on = validate({"model": {**MODEL, "gradient_checkpointing": True}})
    model = build_model_for_world(on, 64, torch.device("cpu"), "fp32", sharded=False)
    blocks = list(model.blocks)  # type: ignore[arg-type]
    assert len(blocks) == 2 and all(checkpoint.state(b) is not None for b in blocks)
    plain = build_model(validate({"model": MODEL}).model, 64)
    assert list(model.state_dict()) == list(plain.state_dict())  # hooks, not wrappers


def test_checkpoint_activations_only_when_asked() -> None:
    off = validate({"model": MODEL})
    model = build_model(off.model, 64)
    checkpoint_activations(model, off.model)
    assert all(checkpoint.state(b) is None for b in model.blocks)  # type: ignore[union-attr]

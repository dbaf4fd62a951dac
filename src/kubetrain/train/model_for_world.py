"""The model as this world trains it: built on the device or on meta and sharded, with activation checkpointing,
compile and LoRA applied from outside (model code stays single-device)."""

from __future__ import annotations

import torch
from torch import nn

from kubetrain.config.schema import Config, ModelConfig
from kubetrain.distributed import parallelize
from kubetrain.models import build_model, builds_on_meta, fill_weights
from kubetrain.models.lora import apply_lora
from kubetrain.train.compile import compile_blocks
from kubetrain.train.device import hf_weight_dtype


def build_model_for_world(cfg: Config, vocab_size: int, device: torch.device, precision: str, sharded: bool
                          ) -> nn.Module:
    """The model for this world. Under FSDP (torchtitan's order): built with meta parameters, activation
    checkpointing and FSDP applied per block, then each process materialises and fills only its shards;
    otherwise built whole on the device (DDP wraps it in Trainer.open). The weights are the same either way."""
    if sharded and device.type == "cpu":
        parallelize.return_freed_memory()
    if sharded and builds_on_meta(cfg.model):
        with parallelize.params_on_meta():
            model = build_model(cfg.model, vocab_size, load_weights=False)
        checkpoint_activations(model, cfg.model)
        if cfg.train.compile:  # torchtitan's order: activation checkpointing, compile each block, then FSDP
            compile_blocks(model)
        parallelize.shard(model, precision)
        parallelize.materialise(model, device)
        fill_weights(model, cfg.model, parallelize.keep_part)
        return model
    # a frozen Hugging Face base (LoRA) loads straight in the training precision (model.dtype auto)
    model_cfg = cfg.model.model_copy(update={"dtype": hf_weight_dtype(cfg, precision, sharded)})
    model = build_model(model_cfg, vocab_size, device=device).to(device)
    if cfg.model.lora is not None:
        model = apply_lora(model, cfg.model.lora)
    checkpoint_activations(model, cfg.model)
    if cfg.train.compile and sharded:  # torchtitan: each block before fully_shard (in Trainer.open)
        compile_blocks(model)
    return model


def checkpoint_activations(model: nn.Module, cfg: ModelConfig) -> None:
    """model.gradient_checkpointing for our GPT, per block from outside (an HF model does its own)."""
    if cfg.gradient_checkpointing and cfg.kind == "gpt":
        parallelize.checkpoint_blocks(model)

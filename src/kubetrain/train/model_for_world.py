"""The model as this world trains it: built whole on the device, or on meta and sharded; LoRA added, then
parallelism applied from outside in one call (distributed.parallelize), so model code stays single-device."""

from __future__ import annotations

import torch
from torch import nn

from kubetrain.config.schema import Config
from kubetrain.distributed import parallelize
from kubetrain.distributed.env import ProcessEnv
from kubetrain.errors import ConfigError
from kubetrain.models import build_model, builds_on_meta, fill_weights
from kubetrain.models.lora import apply_lora
from kubetrain.train.device import hf_weight_dtype


def build_model_for_world(cfg: Config, vocab_size: int, device: torch.device, precision: str, world: ProcessEnv,
                          compiled: bool = False) -> nn.Module:
    """The model for this world, parallelized. Under FSDP/HSDP (torchtitan's order): built with meta parameters,
    LoRA added, parallelized (activation checkpointing, compile, fully_shard per block), then each process
    materialises and fills only its shards: drawn by `ShardInit` from the run's seed (the same weights at every
    world size, not those one process draws), or read from a Hugging Face model's files. Otherwise built whole on
    the device (GPT(cfg)'s init from the global RNG), LoRA added, then parallelized (DDP, compile)."""
    sharded = world.distributed and cfg.dist.shards_weights
    # a frozen Hugging Face base (LoRA) loads straight in the training precision (model.dtype auto)
    model_cfg = cfg.model.model_copy(update={"dtype": hf_weight_dtype(cfg, precision)})
    if sharded and device.type == "cpu":
        parallelize.return_freed_memory()
    if sharded and builds_on_meta(cfg.model):
        with parallelize.params_on_meta():
            model = with_lora(keeps_sequences_apart(build_model(model_cfg, vocab_size, load_weights=False), cfg), cfg)
        model = parallelize.parallelize(model, cfg, world, device, precision, compiled)
        parallelize.materialise(model, device)
        fill_weights(model, model_cfg, parallelize.ShardInit(cfg.run.seed))
        return model
    model = with_lora(keeps_sequences_apart(build_model(model_cfg, vocab_size, device=device), cfg).to(device), cfg)
    return parallelize.parallelize(model, cfg, world, device, precision, compiled)


def keeps_sequences_apart(model: nn.Module, cfg: Config) -> nn.Module:
    """The model, when its attention keeps the sequences of a packed window apart or the data packs none; else a
    ConfigError (exit 2) naming what to change: such a model would silently train on attention across them."""
    from kubetrain.data.shards import documents
    from kubetrain.models.hf import HFCausalLM

    if isinstance(model, HFCausalLM) and documents(cfg):
        problem = model.packed_attention_problem()
        if problem is not None:
            setting = "data.attention: document" if cfg.data.attention == "document" else "data.chat.packing"
            raise ConfigError(f"{setting} needs a model that masks packed sequences, and {cfg.model.name_or_path} "
                              f"does not: {problem}; set {setting.replace(': document', ': causal')}"
                              f"{' false' if setting == 'data.chat.packing' else ''} or use another model")
    return model


def with_lora(model: nn.Module, cfg: Config) -> nn.Module:
    """The model with LoRA adapters when the config asks for them (built on meta too: PEFT adds meta adapters)."""
    return apply_lora(model, cfg.model.lora) if cfg.model.lora is not None else model

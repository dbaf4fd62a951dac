"""The model as this world trains it: built on meta and filled from the run's seed (our GPT), or loaded (a Hugging
Face model); LoRA added, then parallelism applied from outside in one call (distributed.parallelize), so model code
stays single-device, and one seed gives one initial model whatever the strategy and world size."""

from __future__ import annotations

import torch
from torch import nn

from kubetrain.config.schema import Config
from kubetrain.distributed import parallelize
from kubetrain.distributed.env import ProcessEnv
from kubetrain.errors import ConfigError
from kubetrain.models import build_model, builds_on_meta, fill_weights
from kubetrain.models.lora import apply_lora, init_adapters, is_lora
from kubetrain.train.device import hf_weight_dtype


def build_model_for_world(cfg: Config, vocab_size: int, device: torch.device, precision: str, world: ProcessEnv,
                          compiled: bool = False) -> nn.Module:
    """The model for this world, parallelized, starting from the same weights at every strategy and world size.

    Our GPT is always built with meta parameters and its weights drawn by `ShardInit` from the run's seed, so one
    process, DDP, FSDP and HSDP, at any world size, start from the same model (each weight's numbers depend on the
    seed and its name only; torchtitan reaches the same end with a seed checkpoint). Under FSDP/HSDP (torchtitan's
    order) it is parallelized (activation checkpointing, compile, fully_shard per block) before it is materialised,
    so each process allocates and draws only its shards; otherwise it is materialised whole, then parallelized
    (DDP). A Hugging Face model keeps its pretrained weights: under FSDP/HSDP each process reads its shards from
    the files, otherwise the whole model loads; LoRA's adapters are drawn by `ShardInit` either way. With LoRA's
    modules_to_save (PEFT copies whole modules, so nothing is built on meta) every process builds the model whole
    from the global RNG, which the loop seeds alike on every rank: one model again, a different one."""
    sharded = world.distributed and cfg.dist.shards_weights
    # a frozen Hugging Face base (LoRA) loads straight in the training precision (model.dtype auto)
    model_cfg = cfg.model.model_copy(update={"dtype": hf_weight_dtype(cfg, precision)})
    if sharded and device.type == "cpu":
        parallelize.return_freed_memory()
    init = parallelize.ShardInit(cfg.run.seed)
    if builds_on_meta(cfg.model) and (sharded or cfg.model.kind == "gpt"):
        with parallelize.params_on_meta():
            model = with_lora(keeps_sequences_apart(build_model(model_cfg, vocab_size, load_weights=False), cfg), cfg)
        if sharded:
            model = parallelize.parallelize(model, cfg, world, device, precision, compiled)
        parallelize.materialise(model, device)
        fill_weights(model, model_cfg, init)
        return model if sharded else parallelize.parallelize(model, cfg, world, device, precision, compiled)
    model = with_lora(keeps_sequences_apart(build_model(model_cfg, vocab_size, device=device), cfg).to(device), cfg)
    if is_lora(model):  # PEFT drew the adapters from the global RNG; the sharded path draws them by name
        init_adapters(model, init)
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

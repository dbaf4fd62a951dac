"""Models: kubetrain's own GPT and Hugging Face causal LMs (with LoRA), behind one `build_model`."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
from torch import nn

from kubetrain.config.schema import ModelConfig
from kubetrain.models.gpt import GPT, GPTConfig

# bitsandbytes (which PEFT imports whenever it is installed) logs on every import, on CPUs with AVX512-BF16, that the
# optional `kernels` package of a faster 4-bit CPU kernel is missing; its own kernel is used instead and nothing is
# wrong, so that one line is kept out of a healthy run's output (the logger's other records still pass).
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
    lambda record: not record.getMessage().startswith("Failed to load CPU gemm_4bit_forward"))


def gpt_config(cfg: ModelConfig, tokenizer_vocab: int) -> GPTConfig:
    """Our GPT's shape; the vocabulary is rounded up to a multiple of 64 for fast matmuls."""
    vocab = cfg.vocab_size or 64 * math.ceil(tokenizer_vocab / 64)
    if vocab < tokenizer_vocab:
        from kubetrain.errors import ConfigError

        raise ConfigError(f"model.vocab_size ({vocab}) is smaller than the tokenizer's vocabulary ({tokenizer_vocab})")
    return GPTConfig(
        vocab_size=vocab,
        block_size=cfg.block_size,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        n_embd=cfg.n_embd,
        mlp_hidden=cfg.mlp_hidden,
        dropout=cfg.dropout,
        rope_theta=cfg.rope_theta,
        norm_eps=cfg.norm_eps,
        tie_embeddings=cfg.tie_embeddings,
    )


def build_model(cfg: ModelConfig, tokenizer_vocab: int, load_weights: bool = True,
                device: torch.device | None = None) -> nn.Module:
    """The model a config asks for, on the CPU in fp32 (a 4-bit one on `device`); forward maps ids to logits.

    load_weights=False (building with meta parameters, to shard first): a Hugging Face model is built from its
    config.json alone, in its configured dtype; `fill_weights` loads its shards later.
    """
    if cfg.kind == "hf":
        from kubetrain.models.hf import build_hf_model, load_hf_model

        return load_hf_model(cfg, tokenizer_vocab, device) if load_weights else build_hf_model(cfg, tokenizer_vocab)
    return GPT(gpt_config(cfg, tokenizer_vocab))


Init = Callable[[str, torch.Tensor, str, float], None]  # init(name, param, kind, scale): see ShardInit


def builds_on_meta(cfg: ModelConfig) -> bool:
    """Whether the model can be built with meta parameters and filled shard by shard (FSDP): our GPT, and a
    Hugging Face model from a local folder of safetensors files, with LoRA adapters or without. Not with LoRA's
    modules_to_save: PEFT's trained copies of whole modules are built from real weights."""
    if cfg.lora is not None and cfg.lora.modules_to_save:
        return False
    if cfg.kind == "hf":
        from kubetrain.models.hf import safetensors_files

        return bool(safetensors_files(cfg))
    return True


def fill_weights(model: nn.Module, cfg: ModelConfig, init: Init) -> None:
    """Give a model built with meta parameters (then sharded and materialised) its weights: our GPT's init, or a
    Hugging Face model's files (only the shards' bytes), then LoRA's adapters their init.

    A LoRA base layer is named as without LoRA (PEFT's `.base_layer` left out), so it gets the same weights."""
    from kubetrain.models.hf import plain_name
    from kubetrain.models.lora import init_adapters, is_lora

    lora = is_lora(model)
    if cfg.kind == "hf":
        from kubetrain.models.hf import HFCausalLM, load_hf_weights

        assert isinstance(model, HFCausalLM)
        load_hf_weights(model, cfg)
    else:
        gpt = model.get_base_model() if lora else model  # type: ignore[operator]
        assert isinstance(gpt, GPT)
        gpt.init_weights(lambda name, p, kind, scale: init(plain_name(name), p, kind, scale))
    if lora:
        init_adapters(model, init)

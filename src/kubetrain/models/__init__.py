"""Models: kubetrain's own GPT and Hugging Face causal LMs (with LoRA), behind one `build_model`."""

from __future__ import annotations

import math

import torch
from torch import nn

from kubetrain.config.schema import ModelConfig
from kubetrain.models.gpt import GPT, GPTConfig


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


def build_model(cfg: ModelConfig, tokenizer_vocab: int, device: torch.device | None = None) -> nn.Module:
    """The model a config asks for, on the CPU in fp32 (a 4-bit one on `device`); forward maps ids to logits."""
    if cfg.kind == "hf":
        from kubetrain.models.hf import load_hf_model

        return load_hf_model(cfg, tokenizer_vocab, device)
    return GPT(gpt_config(cfg, tokenizer_vocab))

"""GGUF export read back with gguf's reader: llama.cpp's tensor names, shapes, metadata, tokenizer, RoPE."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, TokenType
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from kubetrain.data.tokenizers import load_hf_tokenizer, train_bpe
from kubetrain.export import export
from kubetrain.export.gguf import llama3_rope_factors, rope_settings, write_gguf
from kubetrain.models.gpt import GPT, GPTConfig
from kubetrain.models.hf import HFCausalLM

LAYER_TENSORS = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                 "ffn_down"]


def fields(reader: GGUFReader) -> dict[str, Any]:
    return {name: f.contents() for name, f in reader.fields.items()}


def tensors(reader: GGUFReader) -> dict[str, Any]:
    return {t.name: t for t in reader.tensors}


def rope(x: torch.Tensor, pos: int, theta: float, halves: bool) -> torch.Tensor:
    """RoPE on the last axis: Hugging Face rotates halves, llama.cpp's llama rotates adjacent pairs."""
    d = x.shape[-1]
    angle = pos / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = angle.cos(), angle.sin()
    a, b = (x[..., : d // 2], x[..., d // 2 :]) if halves else (x[..., 0::2], x[..., 1::2])
    ra, rb = a * cos - b * sin, a * sin + b * cos
    return torch.cat([ra, rb], -1) if halves else torch.stack([ra, rb], -1).flatten(-2)


def attention_scores(wq: torch.Tensor, wk: torch.Tensor, x: torch.Tensor, heads: int, kv: int, halves: bool,
                     theta: float) -> torch.Tensor:
    hd = wq.shape[0] // heads
    q = (wq @ x[0]).view(heads, hd)
    k = (wk @ x[1]).view(kv, hd)
    q, k = rope(q, 5, theta, halves), rope(k, 2, theta, halves)
    return torch.stack([q[h] @ k[h // (heads // kv)] for h in range(heads)])


def test_a_merged_llama_lora_run_as_llama_cpp_expects(lora_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "model.gguf"
    export(lora_run, "gguf", out, merge=True, dtype="float32")
    export(lora_run, "hf", tmp_path / "hf", merge=True)
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    reader = GGUFReader(str(out))
    meta, found = fields(reader), tensors(reader)

    assert meta["general.architecture"] == "llama" and meta["general.file_type"] == 0
    expected_meta = {"llama.block_count": 2, "llama.embedding_length": 32, "llama.feed_forward_length": 64,
                     "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2,
                     "llama.context_length": 128, "llama.rope.dimension_count": 8, "llama.vocab_size": 352}
    assert {k: meta[k] for k in expected_meta} == expected_meta
    assert meta["llama.rope.freq_base"] == pytest.approx(10000.0)
    assert meta["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)

    names = {"token_embd.weight", "output_norm.weight", "output.weight"}
    names |= {f"blk.{i}.{t}.weight" for i in range(2) for t in LAYER_TENSORS}
    assert set(found) == names
    shapes = {"token_embd.weight": [32, 352], "output.weight": [32, 352], "blk.1.attn_q.weight": [32, 32],
              "blk.1.attn_k.weight": [32, 16], "blk.1.ffn_down.weight": [64, 32],
              "blk.1.ffn_up.weight": [32, 64], "output_norm.weight": [32]}
    assert {n: list(found[n].shape) for n in shapes} == shapes  # ggml order: the fastest axis first

    # The Q/K permutation: llama.cpp's pair-wise RoPE on the GGUF weights gives Hugging Face's scores.
    layer = merged.model.layers[1].self_attn
    x = torch.randn(2, 32, dtype=torch.float64)
    wq, wk = (torch.from_numpy(found[f"blk.1.attn_{n}.weight"].data.copy()).double() for n in "qk")
    ours = attention_scores(wq, wk, x, 4, 2, False, 1e4)
    hf = attention_scores(layer.q_proj.weight.double(), layer.k_proj.weight.double(), x, 4, 2, True, 1e4)
    torch.testing.assert_close(ours, hf)
    assert np.array_equal(found["blk.1.attn_v.weight"].data, layer.v_proj.weight.detach().numpy())

    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "llama-bpe"
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    vocab = tok.get_vocab()
    assert len(tokens) == len(types) == 352
    assert all(tokens[i] == t for t, i in vocab.items())
    assert types[:5] == [TokenType.CONTROL] * 5 and types[100] == TokenType.NORMAL
    assert tokens[340] == "[PAD340]" and types[340] == TokenType.UNUSED
    merges = json.loads((tmp_path / "hf" / "tokenizer.json").read_text())["model"]["merges"]
    assert meta["tokenizer.ggml.merges"] == [" ".join(m) for m in merges]
    ids = {k: meta[f"tokenizer.ggml.{k}"] for k in ("bos_token_id", "eos_token_id", "padding_token_id")}
    assert ids == {"bos_token_id": 0, "eos_token_id": 1, "padding_token_id": 4}
    assert meta["tokenizer.ggml.add_bos_token"] is True
    assert meta["tokenizer.chat_template"] == tok.chat_template

    # The Ollama Modelfile beside it: the chat template as a Go template, without the BOS the tokenizer adds.
    modelfile = (tmp_path / "Modelfile").read_text().splitlines()
    assert modelfile[1] == "FROM ./model.gguf"
    assert modelfile[2].startswith('TEMPLATE """{{- range .Messages }}{{ if eq .Role "system" }}<|start_header_id|>')
    assert modelfile[-2:] == ['PARAMETER stop "<|eot_id|>"', "PARAMETER num_ctx 64"]


def test_our_gpt_in_float16_with_a_tied_head_and_gpt2_tokenizer(tmp_path: Path) -> None:
    bpe = train_bpe(["the fox and the dog, the cat and the bird " * 20], vocab_size=280)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=320, block_size=32, n_layer=1, n_head=2, n_embd=32))
    write_gguf(model, bpe, tmp_path / "gpt.gguf")
    reader = GGUFReader(str(tmp_path / "gpt.gguf"))
    meta, found = fields(reader), tensors(reader)
    assert "output.weight" not in found  # tied: llama.cpp falls back to token_embd
    assert found["token_embd.weight"].tensor_type == GGMLQuantizationType.F16
    assert found["blk.0.attn_norm.weight"].tensor_type == GGMLQuantizationType.F32
    assert meta["general.file_type"] == 1 and meta["llama.feed_forward_length"] == model.config.hidden
    assert meta["tokenizer.ggml.pre"] == "gpt-2" and meta["tokenizer.ggml.add_bos_token"] is False
    assert meta["tokenizer.ggml.eos_token_id"] == bpe.eos_id
    tokens = meta["tokenizer.ggml.tokens"]
    assert tokens[: bpe.vocab_size] == [bpe.tok.id_to_token(i) for i in range(bpe.vocab_size)]
    assert len(tokens) == 320


def test_llama3_rope_scaling_becomes_rope_freqs(hf_tokenizer_dir: Path, tmp_path: Path) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    config = LlamaConfig(vocab_size=352, hidden_size=256, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=131072,
                         rope_parameters=scaling)
    theta, params = rope_settings(config)
    factors = llama3_rope_factors(config, theta, params)
    plain = 1.0 / (theta ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128))
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    np.testing.assert_allclose(factors, (plain / scaled).numpy(), rtol=1e-5)
    assert factors[0] == 1.0 and factors[-1] == 32.0  # both regimes and the smooth one in between

    torch.manual_seed(0)
    model = HFCausalLM(LlamaForCausalLM(config), block_size=64)
    write_gguf(model, load_hf_tokenizer(str(hf_tokenizer_dir)), tmp_path / "l3.gguf", dtype="f32")
    found = tensors(GGUFReader(str(tmp_path / "l3.gguf")))
    np.testing.assert_array_equal(found["rope_freqs.weight"].data, factors)


# llama.cpp's EOG names (src/llama-vocab.cpp, llama_vocab::impl::load), the subset a byte-level BPE can hold.
LLAMA_CPP_EOG_TEXTS = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
                       "<EOT>", "<|end_of_text|>"}


def llama_cpp_special_tokens(meta: dict[str, Any]) -> tuple[dict[str, int | None], set[int], list[str]]:
    """(bos/eos ids, end-of-generation ids, load warnings) as llama.cpp's loader derives them for a `gpt2` vocab.

    Follows llama_vocab::impl::load: a gpt2 vocab defaults BOS and EOS to id 11 (disabled only when out of
    range); a key in range replaces the default, one out of range warns and keeps it; EOG holds the tokens named
    like an end token, then EOS with a warning when it is not among them; add_bos without a BOS is an error.
    """
    tokens = meta["tokenizer.ggml.tokens"]
    ids: dict[str, int | None] = {}
    warnings = []
    for name in ("bos", "eos"):
        default = 11 if len(tokens) > 11 else None
        key = meta.get(f"tokenizer.ggml.{name}_token_id")
        if key is not None and key >= len(tokens):
            warnings.append(f"bad special token: '{name}' = {key}, using default id {default}")
        ids[name] = key if key is not None and key < len(tokens) else default
    if meta.get("tokenizer.ggml.add_bos_token") and ids["bos"] is None:
        raise ValueError("add_bos_token is true, but bos_token_id is not set")
    eog = {i for i, t in enumerate(tokens) if t in LLAMA_CPP_EOG_TEXTS}
    if ids["eos"] is not None and ids["eos"] not in eog:
        warnings.append("special_eos_id is not in special_eog_ids - the tokenizer config may be incorrect")
        eog.add(ids["eos"])
    return ids, eog, warnings


def test_a_byte_tokenizer_run_keeps_one_token_per_byte_and_real_specials(tmp_path: Path) -> None:
    from kubetrain.data.tokenizers import ByteTokenizer
    from kubetrain.export.hf import BYTE_BOS, BYTE_EOS, _bytes_to_unicode

    torch.manual_seed(0)
    # 256 embeddings, as every byte run has had: old checkpoints export the same way.
    write_gguf(GPT(GPTConfig(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=16)), ByteTokenizer(),
               tmp_path / "byte.gguf")
    meta = fields(GGUFReader(str(tmp_path / "byte.gguf")))
    alphabet = _bytes_to_unicode()
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert tokens[:254] == [alphabet[b] for b in range(254)] and tokens[254:] == [BYTE_BOS, BYTE_EOS]
    assert tokens[ord("A")] == "A" and tokens[32] == "Ġ"
    assert types[:254] == [TokenType.NORMAL] * 254 and types[254:] == [TokenType.CONTROL] * 2
    assert meta["tokenizer.ggml.merges"] == ["<no> <merges>"]  # present, and never applicable
    assert meta["tokenizer.ggml.add_bos_token"] is False  # kubetrain adds none to a byte prompt either
    ids, eog, warnings = llama_cpp_special_tokens(meta)
    assert warnings == []  # no fallback to byte 11 (a vertical tab) for BOS and EOS
    assert ids == {"bos": 0xFE, "eos": 0xFF}
    assert eog == {ByteTokenizer.eos_id}  # llama.cpp stops on the token kubetrain's sampler stops on

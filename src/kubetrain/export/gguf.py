"""GGUF for llama.cpp / Ollama: our GPT and Llama-architecture Hugging Face models, tokenizer included.

Written as llama.cpp's own converter (convert_hf_to_gguf.py) writes the `llama` architecture: tensor names
from gguf's name map, Q and K rows permuted from Hugging Face's rotate-halves RoPE to llama.cpp's
adjacent pairs, 1-D tensors in f32, Llama 3 RoPE scaling as a `rope_freqs` tensor, and the tokenizer as a
byte-level BPE (`gpt2` model) with its merges, token types and pre-tokenizer name.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kubetrain.data.tokenizers import Tokenizer
from kubetrain.errors import UserInputError
from kubetrain.export.hf import gpt_llama_config, gpt_state_as_llama, to_hf_tokenizer
from kubetrain.models.gpt import GPT
from kubetrain.models.hf import HFCausalLM

# The pre-tokenizer regex of Llama 3 (llama.cpp calls it "llama-bpe").
LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)


NO_MERGE = "<no> <merges>"


def permute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Reorder the rows of each head from rotated halves (HF) to interleaved pairs (llama.cpp's llama)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope_settings(config: Any) -> tuple[float, dict[str, Any]]:
    """(theta, scaling) of a transformers config: 5.x rope_parameters, or 4.x rope_theta / rope_scaling."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    merged = {**scaling, **params}
    merged.setdefault("rope_type", merged.get("type", "default"))
    return theta, merged


def llama3_rope_factors(config: Any, theta: float, rope: dict[str, Any]) -> np.ndarray:
    """Per-frequency divisors of Llama 3's RoPE scaling, as llama.cpp reads them from `rope_freqs.weight`."""
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_ctx = rope.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    factors = []
    for freq in 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def tokenizer_fields(hf_tok: Any, n_vocab: int) -> dict[str, Any]:
    """tokens, token types, merges, pre-tokenizer and special ids of a byte-level BPE, padded to n_vocab."""
    import gguf

    raw = json.loads(hf_tok.backend_tokenizer.to_str())
    model, pre = raw.get("model") or {}, raw.get("pre_tokenizer") or {}
    if model.get("type") != "BPE" or "ByteLevel" not in json.dumps([pre, raw.get("decoder")]):
        raise UserInputError(
            "GGUF export supports byte-level BPE tokenizers (GPT-2, Llama 3 style); "
            f"this one is {model.get('type')}"
        )
    vocab = hf_tok.backend_tokenizer.get_vocab(with_added_tokens=True)
    if len(vocab) > n_vocab:
        raise UserInputError(f"the tokenizer has {len(vocab)} tokens, the model only {n_vocab} embeddings")
    by_id = {i: t for t, i in vocab.items()}
    added = {i: a for i, a in hf_tok.added_tokens_decoder.items()}
    tokens, types = [], []
    for i in range(n_vocab):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(by_id[i])
            special = i in added and added[i].special
            types.append(gguf.TokenType.CONTROL if special else
                         gguf.TokenType.USER_DEFINED if i in added else gguf.TokenType.NORMAL)
    # llama.cpp refuses a BPE vocabulary without a merges key and gguf cannot write an empty array: a byte
    # tokenizer gets one merge of two multi-character symbols, which never applies (symbols start as chars).
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])] or [NO_MERGE]
    with_specials = list(hf_tok("a", add_special_tokens=True)["input_ids"])
    bos = hf_tok.bos_token_id
    return {
        "tokens": tokens,
        "types": types,
        "merges": merges,
        "pre": _pre_name(pre),
        "bos": bos,
        "eos": hf_tok.eos_token_id,
        "pad": hf_tok.pad_token_id,
        "add_bos": bos is not None and with_specials[:1] == [bos],
        "chat_template": getattr(hf_tok, "chat_template", None),
    }


def _pre_name(pre: dict[str, Any]) -> str:
    """llama.cpp's name for a pre-tokenizer (its converter recognises the same ones)."""
    if pre.get("type") == "ByteLevel":
        return "gpt-2"
    if pre.get("type") == "Sequence":
        splits = [p for p in pre.get("pretokenizers", []) if p.get("type") == "Split"]
        regexes = [p.get("pattern", {}).get("Regex") for p in splits]
        if LLAMA3_REGEX in regexes:
            return "llama-bpe"
    return "default"


def llama_parts(model: GPT | HFCausalLM, tokenizer: Tokenizer) -> tuple[dict[str, torch.Tensor], Any]:
    """(weights under Hugging Face Llama names, its LlamaConfig) for our GPT or a Llama HF model."""
    if isinstance(model, GPT):
        return gpt_state_as_llama(model), gpt_llama_config(model, tokenizer)
    config = model.lm.config
    if getattr(config, "model_type", None) != "llama":
        raise UserInputError(
            f"GGUF export supports our GPT and Llama-architecture models; this one is '{config.model_type}'"
        )
    state = {k: v.detach() for k, v in model.lm.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # llama.cpp reuses token_embd when `output` is absent
    return state, config


def write_gguf(
    model: GPT | HFCausalLM, tokenizer: Tokenizer, out: Path, dtype: str = "f16", name: str = "",
    chat_template: str | None = None,
) -> None:
    """One .gguf file, written atomically: 2-D weights in `dtype` (f32 or f16), norms and RoPE in f32.

    `chat_template` (Jinja) is the run's own when its config sets one; else the tokenizer's is written.
    """
    import gguf

    state, config = llama_parts(model, tokenizer)
    n_head, n_kv = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_head
    theta, rope = rope_settings(config)
    n_vocab = state["model.embed_tokens.weight"].shape[0]
    tok = tokenizer_fields(to_hf_tokenizer(tokenizer), n_vocab)

    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(name or out.stem)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == "f32" else gguf.LlamaFileType.MOSTLY_F16)
    w.add_vocab_size(n_vocab)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_dimension_count(head_dim)
    if head_dim != config.hidden_size // n_head:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(theta)
    if rope["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif rope["rope_type"] not in ("default", "llama3"):
        raise UserInputError(f"GGUF export does not handle RoPE scaling of type '{rope['rope_type']}'")

    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(tok["pre"])
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    w.add_token_merges(tok["merges"])
    for key, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id), ("pad", w.add_pad_token_id)):
        if tok[key] is not None:
            add(tok[key])
    w.add_add_bos_token(tok["add_bos"])
    if chat_template or tok["chat_template"]:
        w.add_chat_template(chat_template or tok["chat_template"])

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    if rope["rope_type"] == "llama3":
        freqs = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"
        w.add_tensor(freqs, llama3_rope_factors(config, theta, rope))
    for hf_name, t in state.items():
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise UserInputError(f"GGUF export: no llama.cpp name for tensor {hf_name}")
        t = t.float()
        if hf_name.endswith("self_attn.q_proj.weight"):
            t = permute_rope(t, n_head)
        elif hf_name.endswith("self_attn.k_proj.weight"):
            t = permute_rope(t, n_kv)
        data = t.numpy()
        w.add_tensor(gguf_name, data.astype(np.float16) if dtype == "f16" and data.ndim > 1 else data)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)

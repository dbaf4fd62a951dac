"""Hugging Face folders: our GPT as a Llama (same logits), HF runs as they are, LoRA merged or as adapters.

Our GPT is the Llama architecture (RoPE with rotated halves, RMSNorm, SwiGLU, no biases), so exporting it is
a renaming of its weights plus a LlamaConfig; no tensor is permuted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from kubetrain.data.tokenizers import ByteTokenizer, FastTokenizer, HFTokenizer, Tokenizer
from kubetrain.errors import UserInputError
from kubetrain.models.gpt import GPT
from kubetrain.models.hf import HFCausalLM

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

_GPT_TO_LLAMA = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.v_proj.weight": "self_attn.v_proj.weight",
    "attn.o_proj.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
}


def is_tied(model: GPT) -> bool:
    """Whether lm_head still shares the embedding (a LoRA modules_to_save copy unties them)."""
    return model.lm_head.weight.data_ptr() == model.embed.weight.data_ptr()


def gpt_state_as_llama(model: GPT) -> dict[str, torch.Tensor]:
    """Our GPT's weights under LlamaForCausalLM's names."""
    out = {"model.embed_tokens.weight": model.embed.weight, "model.norm.weight": model.norm.weight}
    for i, block in enumerate(model.blocks):
        for name, t in block.state_dict().items():
            out[f"model.layers.{i}.{_GPT_TO_LLAMA[name]}"] = t
    if not is_tied(model):
        out["lm_head.weight"] = model.lm_head.weight
    return {k: v.detach().contiguous() for k, v in out.items()}


def gpt_llama_config(model: GPT, tokenizer: Tokenizer) -> Any:
    """The LlamaConfig that describes our GPT."""
    from transformers import LlamaConfig

    c = model.config
    hf_tok = to_hf_tokenizer(tokenizer)
    rope: dict[str, Any] = {"rope_theta": c.rope_theta}  # the 4.x name; 5.x moves it into rope_parameters
    config = LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.n_embd,
        intermediate_size=c.hidden,
        num_hidden_layers=c.n_layer,
        num_attention_heads=c.n_head,
        num_key_value_heads=c.n_head,
        head_dim=c.head_dim,
        max_position_embeddings=c.block_size,
        rms_norm_eps=c.norm_eps,
        **rope,
        tie_word_embeddings=is_tied(model),
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=hf_tok.bos_token_id,
        eos_token_id=tokenizer.eos_id,
        pad_token_id=hf_tok.pad_token_id,
    )
    config.architectures = ["LlamaForCausalLM"]
    return config


def to_hf_tokenizer(tokenizer: Tokenizer) -> Any:
    """The run's tokenizer as a transformers tokenizer (what from_pretrained and GGUF conversion read)."""
    from transformers import PreTrainedTokenizerFast

    if isinstance(tokenizer, HFTokenizer):
        return tokenizer.tok
    if isinstance(tokenizer, FastTokenizer):
        eos = tokenizer.tok.id_to_token(tokenizer.eos_id) if tokenizer.eos_id is not None else None
        return PreTrainedTokenizerFast(tokenizer_object=tokenizer.tok, eos_token=eos)
    if isinstance(tokenizer, ByteTokenizer):
        return PreTrainedTokenizerFast(tokenizer_object=byte_level_tokenizer(), bos_token=BYTE_BOS,
                                       eos_token=BYTE_EOS)
    raise UserInputError(f"a run with a {tokenizer.kind} tokenizer cannot be exported (byte, bpe and hf can)")


BYTE_BOS, BYTE_EOS = "<|startoftext|>", "<|endoftext|>"  # llama.cpp ends generation on <|endoftext|> by name


def byte_level_tokenizer() -> Any:
    """Our byte tokenizer as a `tokenizers` BPE without merges: id b is byte b, written GPT-2 style.

    Ids 0xFE and 0xFF (bytes no UTF-8 text holds) are its BOS and EOS special tokens.
    """
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer

    alphabet = _bytes_to_unicode()
    n_bytes = ByteTokenizer.bos_id
    tok = RawTokenizer(models.BPE(vocab={alphabet[b]: b for b in range(n_bytes)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(BYTE_BOS, special=True), AddedToken(BYTE_EOS, special=True)])
    assert tok.token_to_id(BYTE_EOS) == ByteTokenizer.eos_id
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (the alphabet of byte-level BPE vocabularies)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    chars, n = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + n)
            n += 1
    return chars


def save_gpt(model: GPT, tokenizer: Tokenizer, out: Path, dtype: str = "float32") -> None:
    """Our GPT as a Llama folder: model.safetensors, config.json, generation_config.json, tokenizer files."""
    from safetensors.torch import save_file

    config = gpt_llama_config(model, tokenizer)
    config.dtype = DTYPES[dtype]
    state = {k: v.to(DTYPES[dtype]) for k, v in gpt_state_as_llama(model).items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(out))
    generation_config(config).save_pretrained(str(out))
    # Older readers (transformers 4.x, llama.cpp's converter) look for rope_theta at the top level.
    raw = json.loads((out / "config.json").read_text())
    raw.setdefault("rope_theta", model.config.rope_theta)
    (out / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    to_hf_tokenizer(tokenizer).save_pretrained(str(out))


def generation_config(config: Any) -> Any:
    """generation_config.json: BOS, EOS and padding ids, so `generate` stops on the run's EOS."""
    from transformers import GenerationConfig

    return GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                            pad_token_id=config.pad_token_id)


def save_hf(model: HFCausalLM, tokenizer: Tokenizer, out: Path, dtype: str | None = None) -> None:
    """A (merged) Hugging Face model as a folder with safetensors and its tokenizer."""
    lm = model.lm
    if dtype is not None:
        lm = lm.to(DTYPES[dtype])
    lm.config.use_cache = True  # training turned it off; inference wants it
    lm.save_pretrained(str(out), safe_serialization=True)
    to_hf_tokenizer(tokenizer).save_pretrained(str(out))


def save_adapter(model: HFCausalLM, tokenizer: Tokenizer, out: Path) -> None:
    """The LoRA adapter alone, in PEFT's format: PeftModel.from_pretrained(base, out) loads it."""
    model.lm.save_pretrained(str(out))
    to_hf_tokenizer(tokenizer).save_pretrained(str(out))

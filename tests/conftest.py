"""Tiny random-initialised Hugging Face models, tokenizers and chat data, built in a temporary folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
SPECIALS = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|pad|>"]
WORDS = ["red", "green", "blue", "cat", "dog", "bird", "one", "two", "three", "sun", "moon", "star"]


def chat_rows(n: int = 48) -> list[dict[str, object]]:
    """A learnable toy task: the assistant repeats the user's words in reverse order."""
    rows: list[dict[str, object]] = []
    for i in range(n):
        words = [WORDS[(i * 7 + k * 5) % len(WORDS)] for k in range(3 + i % 3)]
        user = "reverse: " + " ".join(words)
        answer = " ".join(reversed(words))
        if i % 4 == 3:
            rows.append({"prompt": user, "response": answer})
        else:
            rows.append({"messages": [{"role": "system", "content": "be brief"},
                                      {"role": "user", "content": user},
                                      {"role": "assistant", "content": answer}]})
    return rows


def build_tokenizer(folder: Path) -> Path:
    """A byte-level BPE like Llama 3's: BOS added by the post-processor, a Llama-3-style chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=330, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [json.dumps(r) for r in chat_rows()] + ["reverse: " + " ".join(WORDS), "be brief"]
    tok.train_from_iterator(corpus * 4, trainer=trainer)
    bos = "<|begin_of_text|>"
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token="<|eot_id|>",
                                   pad_token="<|pad|>")
    fast.chat_template = LLAMA3_TEMPLATE
    fast.save_pretrained(str(folder))
    return folder


def build_llama(folder: Path, vocab: int, tie: bool = False, seed: int = 0) -> Path:
    """A 2-layer Llama (hidden 32, grouped-query attention) saved with its tokenizer, like a hub snapshot."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=tie, bos_token_id=0, eos_token_id=1, pad_token_id=4)
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="session")
def hf_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory, hf_tokenizer_dir: Path) -> Path:
    """Model + tokenizer in one folder; the vocabulary is larger than the tokenizer's (padded rows)."""
    import shutil

    folder = tmp_path_factory.mktemp("llama")
    for f in hf_tokenizer_dir.iterdir():
        shutil.copy(f, folder / f.name)
    return build_llama(folder, vocab=352)


@pytest.fixture(scope="session")
def chat_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in chat_rows()))
    return path

"""Tiny random-initialised Hugging Face models, tokenizers and chat data, built in a temporary folder (fixtures)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from kubetrain.config.schema import Config

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
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


def skewed_chat_rows(n: int = 400, long_words: int = 40, seed: int = 0) -> list[dict[str, object]]:
    """Chat lengths as fine-tuning sets have them: most conversations short, one in eight long (about `long_words`
    words of answer, near the window when `long_words` is chosen so), the rest between."""
    import random

    rng = random.Random(seed)
    rows: list[dict[str, object]] = []
    for i in range(n):
        kind = rng.random()
        answer = rng.randint(long_words * 3 // 4, long_words) if kind < 0.125 else rng.randint(1, long_words // 5)
        words = [WORDS[rng.randrange(len(WORDS))] for _ in range(2 + rng.randrange(4))]
        rows.append({"prompt": f"{i}: " + " ".join(words),
                     "response": " ".join(WORDS[rng.randrange(len(WORDS))] for _ in range(answer))})
    return rows


def build_tokenizer(folder: Path) -> Path:
    """A byte-level BPE like Llama 3's: its pre-tokenizer, BOS from the post-processor, its chat format."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([  # Llama 3's: its split regex, then bytes
        pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
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


def build_llama(folder: Path, vocab: int, tie: bool = False, seed: int = 0, hidden: int = 32) -> Path:
    """A 2-layer Llama (hidden 32, grouped-query attention) saved with its tokenizer, like a hub snapshot."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    # initializer_range 0.2: a frozen random head with the default 0.02 cannot express a confident prediction
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=tie, initializer_range=0.2, bos_token_id=0, eos_token_id=1,
                      pad_token_id=4)
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


def lora_config(out: Path, llama: Path, chat: Path, **overrides: object) -> Config:
    """A LoRA fine-tune of the tiny Llama on the chat set: one conversation per 64-token window."""
    from kubetrain.config.loading import validate

    raw: dict[str, object] = {
        "run": {"name": "lora", "output_dir": str(out), "threads": 1, "seed": 7},
        "data": {"sources": [{"kind": "chat", "path": str(chat)}], "val_fraction": 0.1},
        "model": {"kind": "hf", "name_or_path": str(llama), "block_size": 64,
                  "lora": {"r": 8, "alpha": 16, "dropout": 0.05,
                           "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                              "down_proj"]}},
        "train": {"max_steps": 24, "micro_batch_size": 4, "lr": 2e-2, "warmup_steps": 2,
                  "log_every_steps": 1},
        "eval": {"every_steps": 8, "windows": 1, "sample_prompt": None, "sample_tokens": 4},
        "checkpoint": {"every_steps": 8, "keep_last": 5},
        "track": {"console": False},
    }
    for key, value in overrides.items():
        section, name = key.split("__")
        raw[section][name] = value  # type: ignore[index]
    return validate(raw)


@pytest.fixture(scope="session")
def make_lora_config() -> Callable[..., Config]:
    """lora_config(out, llama, chat, section__key=value, ...): a variant of the LoRA run's config."""
    return lora_config


@pytest.fixture(scope="session")
def lora_run(tmp_path_factory: pytest.TempPathFactory, llama_dir: Path, chat_file: Path) -> Path:
    """A finished 24-step LoRA run (checkpoints at steps 8, 16, 24)."""
    from kubetrain.train.trainer import train

    cfg = lora_config(tmp_path_factory.mktemp("runs"), llama_dir, chat_file)
    return Path(train(cfg, log=lambda m: None).run_dir)


@pytest.fixture(scope="session")
def hf_full_run(tmp_path_factory: pytest.TempPathFactory, llama_dir: Path, chat_file: Path) -> Path:
    """A full fine-tune (no LoRA) of the tiny Llama: 3 steps."""
    from kubetrain.config.loading import validate
    from kubetrain.train.trainer import train

    cfg = validate({
        "run": {"name": "full", "output_dir": str(tmp_path_factory.mktemp("full")), "threads": 1},
        "data": {"sources": [{"kind": "chat", "path": str(chat_file)}], "val_fraction": 0.1},
        "model": {"kind": "hf", "name_or_path": str(llama_dir), "block_size": 64},
        "train": {"max_steps": 3, "micro_batch_size": 2, "lr": 1e-3, "warmup_steps": 0},
        "eval": {"every_steps": 3, "windows": 1, "sample_prompt": None, "sample_tokens": 2},
        "track": {"console": False},
    })
    return Path(train(cfg, log=lambda m: None).run_dir)


@pytest.fixture(scope="session")
def gpt_lora_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Our GPT with LoRA on every projection and a trained copy of the (tied) lm_head; 4 steps."""
    from kubetrain.config.loading import validate
    from kubetrain.train.trainer import train

    root = tmp_path_factory.mktemp("gpt-lora")
    text = root / "corpus.txt"
    text.write_text(" ".join(f"{w} {WORDS[(i * 5) % len(WORDS)]}." for i, w in enumerate(WORDS * 40)))
    cfg = validate({
        "run": {"name": "gpt-lora", "output_dir": str(root / "runs"), "threads": 1},
        "data": {"sources": [{"kind": "text", "path": str(text)}],
                 "tokenizer": {"kind": "bpe", "vocab_size": 300}},
        "model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32,
                  "lora": {"r": 4, "alpha": 8, "modules_to_save": ["lm_head"],
                           "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                              "down_proj"]}},
        "train": {"max_steps": 4, "micro_batch_size": 2, "lr": 1e-2, "warmup_steps": 0},
        "eval": {"every_steps": 4, "windows": 1, "sample_prompt": None, "sample_tokens": 2},
        "track": {"console": False},
    })
    return Path(train(cfg, log=lambda m: None).run_dir)

"""A tiny random Llama and its byte-level BPE tokenizer, built in a folder like a hub snapshot (nothing is
downloaded): the Hugging Face checks train, sample and export it."""

from __future__ import annotations

from pathlib import Path

WORDS = ["red", "green", "blue", "cat", "dog", "bird", "one", "two", "three", "sun", "moon", "star"]


def corpus(lines: int = 400) -> str:
    """Short sentences with a pattern a LoRA learns in a few steps: the same words, in a fixed rotation."""
    return "\n".join(" ".join(WORDS[(i + k) % len(WORDS)] for k in range(6)) + "." for i in range(lines)) + "\n"


def build(folder: Path, hidden: int = 64, seed: int = 0) -> Path:
    """A 2-layer Llama (grouped-query attention) and a GPT-2-style byte-level BPE tokenizer in `folder`."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"]
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(40).splitlines() * 4, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{specials[0]} $A", special_tokens=[(specials[0], 0)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=specials[0], eos_token=specials[1],
                            pad_token=specials[2]).save_pretrained(str(folder))
    vocab = -(-tok.get_vocab_size() // 64) * 64
    # initializer_range 0.2: a random head with the default 0.02 gives near-uniform logits (greedy ties)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      initializer_range=0.2, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(str(folder))
    return folder

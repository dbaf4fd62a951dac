"""Autoregressive sampling for any model whose forward maps token ids to logits."""

from __future__ import annotations

import contextlib
import secrets
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


@torch.no_grad()
def generate(
    model: nn.Module,
    ids: list[int],
    max_new_tokens: int,
    block_size: int,
    temperature: float = 0.8,
    top_k: int | None = 50,
    eos_id: int | None = None,
    seed: int | None = None,
    autocast_ctx: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    progress: Callable[[int, int], None] | None = None,
) -> list[int]:
    """Continue `ids` by up to `max_new_tokens` tokens; temperature 0 is greedy.

    A model with `new_kv_cache` (our GPT, Hugging Face models) reads the prompt once and then one token per
    forward when everything fits in the block; past it the context is cropped to the block, a full forward each.

    `autocast_ctx` is the training loop's autocast factory: samples on a GPU run in the training dtype
    (bf16/fp16 tensor cores), not in fp32. `progress(done, total)` hears of every token (see `Progress`).
    """
    if not ids:
        raise ValueError("generate needs a prompt of at least one token")
    device = next(model.parameters()).device
    gen = torch.Generator(device=device)
    # Without a seed, a fresh one from the OS: torch.seed() would reseed the global generator too.
    gen.manual_seed(seed if seed is not None else secrets.randbits(63))
    was_training = model.training
    model.eval()
    x = torch.tensor([ids], dtype=torch.long, device=device)
    new_cache = getattr(model, "new_kv_cache", None)
    cache = new_cache() if callable(new_cache) and len(ids) + max_new_tokens <= block_size else None
    out: list[int] = []
    for step in range(max_new_tokens):
        with autocast_ctx():
            if cache is None:
                logits = model(x[:, -block_size:])[:, -1, :].float()
            else:  # the whole prompt first, then only the token just sampled
                logits = model(x if step == 0 else x[:, -1:], kv_cache=cache)[:, -1, :].float()
        if temperature <= 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1, None]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)
        token = int(nxt)
        if eos_id is not None and token == eos_id:
            break
        out.append(token)
        x = torch.cat([x, nxt], dim=1)
        if progress is not None:
            progress(len(out), max_new_tokens)
    model.train(was_training)
    return out


class Progress:
    """A line every `every` seconds while tokens are generated ("sample: 40/192 tokens, 3.1 tokens/s"), so a long
    sample on a slow CPU is not silent; nothing for one that ends sooner (the usual case)."""

    def __init__(self, what: str, say: Callable[[str], None] | None = None, every: float = 10.0) -> None:
        self.what, self.every = what, every
        self.say = say or (lambda m: print(m, file=sys.stderr, flush=True))
        self.t0 = self.last = time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self.last >= self.every and done < total:
            self.last = now
            self.say(f"{self.what}: {done}/{total} tokens, {done / (now - self.t0):.1f} tokens/s")

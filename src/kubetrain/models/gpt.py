"""kubetrain's own GPT decoder: RoPE, RMSNorm, SwiGLU, tied embeddings, causal SDPA, scaled init.

A packed window (several sequences in one, `position_ids` restarting at 0 at each) attends within each sequence
only, with rotary positions counted from each sequence's start (models/documents.py): its logits are each
sequence's own.

Single-device code: DDP/FSDP, compile and mixed precision are applied from outside (distributed/, train/).
It is the Llama architecture, so export/ maps it onto a Llama config for Hugging Face and GGUF.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kubetrain.models.documents import DocumentMask, document_mask
from kubetrain.models.loss import linear_loss_sum, lm_loss_sum


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    mlp_hidden: int | None = None
    dropout: float = 0.0
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def hidden(self) -> int:
        # SwiGLU keeps the parameter count of a 4x MLP with 2/3 of the width; round up for fast matmuls.
        return self.mlp_hidden or 64 * math.ceil(8 * self.n_embd / 3 / 64)

    @property
    def parameters(self) -> int:
        """How many parameters GPT(self) has, without building it: the memory estimate of a launcher or `doctor`,
        which trains nothing, builds no model (on the meta device it is initialised through torch._refs, which
        imports Dynamo: a second or more of such a process's start on a CPU)."""
        d = self.n_embd
        block = 4 * d * d + 3 * d * self.hidden + 2 * d  # q, k, v, o; gate, up, down; two norms
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.n_layer * block + d + head


def rope_cache(cfg: GPTConfig, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin of shape (block_size, head_dim), laid out for `apply_rope`'s rotate-halves.

    The sin table is (-sin, sin) over the two halves, so rotating needs no negation at run time.
    """
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=device).float() / cfg.head_dim))
    freqs = torch.outer(torch.arange(cfg.block_size, device=device).float(), inv)
    return torch.cat([freqs.cos(), freqs.cos()], dim=-1), torch.cat([-freqs.sin(), freqs.sin()], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves of x (..., T, D): the Llama / HF convention, so exported weights need no permutation."""
    x1, x2 = x.chunk(2, dim=-1)
    # The tables are fp32; under bf16 autocast q and k must stay bf16 (no-op casts in fp32).
    return torch.addcmul(x * cos.to(x.dtype), torch.cat([x2, x1], dim=-1), sin.to(x.dtype))


def autocast_input(x: torch.Tensor) -> torch.Tensor:
    """`x` in autocast's dtype, cast once for the projections that share it (q, k and v; gate and up).

    Autocast casts a linear's input at each call: three bf16 copies of the attention's input, each kept for the
    backward, and three cast kernels. One explicit cast gives the same forward with one copy (the gradients of the
    shared input are then summed in bf16, as under FSDP's bf16 policy and torchtitan's). Compiled, Inductor
    already shares the cast: left to it."""
    device = x.device.type
    if torch.compiler.is_compiling() or not torch.is_autocast_enabled(device):
        return x
    return x.to(torch.get_autocast_dtype(device))


class KVCache:
    """Keys and values of the tokens seen so far, per layer: sampling feeds one new token per forward."""

    def __init__(self, n_layer: int) -> None:
        self.kv: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * n_layer
        self.length = 0  # tokens cached (every layer holds the same)

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this forward's keys and values (B, H, T, D) to the layer's; return all of them."""
        held = self.kv[layer]
        if held is not None:
            k, v = torch.cat([held[0], k], dim=2), torch.cat([held[1], v], dim=2)
        self.kv[layer] = (k, v)
        return k, v


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.o_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: tuple[KVCache, int] | None = None, documents: DocumentMask | None = None) -> torch.Tensor:
        B, T, C = x.shape
        x = autocast_input(x)
        # Three matmuls measured faster on the CPU than one fused qkv (no weight concat, no strided views).
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        causal = True
        if cache is not None:  # the prompt fills an empty cache (causal), then one query sees every key
            k, v = cache[0].extend(cache[1], k, v)
            causal = T > 1
        dropout = self.dropout if self.training else 0.0
        if documents is not None:  # a packed window: each token attends within its own sequence
            y = documents.attend(q, k, v, dropout)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=dropout)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, C))


class SwiGLU(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.n_embd, cfg.hidden, bias=False)
        self.up_proj = nn.Linear(cfg.n_embd, cfg.hidden, bias=False)
        self.down_proj = nn.Linear(cfg.hidden, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = autocast_input(x)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _RMSNormFunction(torch.autograd.Function):
    """RMSNorm with a hand-written backward: on the CPU, autograd through the composite op is ~2x slower."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        normed = x * rstd
        ctx.save_for_backward(normed, rstd, weight)
        return normed * weight

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        normed, rstd, weight = ctx.saved_tensors
        width = grad.shape[-1]
        p = (grad * normed).reshape(-1, width)
        # grad_x = rstd * (g - normed * mean(g * normed)) with g = grad * weight; the row means are one
        # matrix-vector product with the weight, so the big tensors are read as few times as possible.
        mean = torch.mv(p, weight).view(*grad.shape[:-1], 1).div_(width)
        grad_x = torch.addcmul(grad * weight, normed, mean, value=-1).mul_(rstd)
        return grad_x, p.sum(0), None


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm (same weights, same forward numerics), with a faster backward for fp32 on the CPU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and x.dtype == self.weight.dtype and self.eps is not None:
            out: torch.Tensor = _RMSNormFunction.apply(x, self.weight, self.eps)
            return out
        return super().forward(x)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: tuple[KVCache, int] | None = None, documents: DocumentMask | None = None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.attn_norm(x), cos, sin, cache, documents))
        return x + self.drop(self.mlp(self.mlp_norm(x)))


class GPT(nn.Module):
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        cos, sin = rope_cache(cfg)
        # Buffers are recomputed, not saved: checkpoints hold learned weights only.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 init; projections that write into the residual stream are scaled by 1/sqrt(2 * n_layer)."""
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, mean=0.0, std=self.init_std(name))

    def init_std(self, name: str) -> float:
        """The std of a weight matrix's normal init, by its name."""
        residual = {"o_proj", "down_proj"} & set(name.split("."))
        return 0.02 / math.sqrt(2 * self.config.n_layer) if residual else 0.02

    def init_weights(self, init: Callable[[str, torch.Tensor, str, float], None]) -> None:
        """Initialise a GPT built with meta parameters (then sharded and materialised): init(name, param, kind,
        scale) fills each weight, norms with ones, matrices from a normal of `init_std` (GPT(cfg)'s distributions;
        the numbers are the caller's: a sharded init draws each process's part only)."""
        for name, p in self.named_parameters():
            if p.dim() < 2:
                init(name, p, "constant", 1.0)
            else:
                init(name, p, "normal", self.init_std(name))

    def forward(self, input_ids: torch.Tensor, kv_cache: KVCache | None = None,
                labels: torch.Tensor | None = None, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, vocab) for token ids (B, T), which follow the tokens in `kv_cache` when one is given; with
        `labels` (B, T) instead the summed cross-entropy of those logits (fp32), made chunk by chunk with the head
        so the whole logits never exist (models/loss.py `linear_loss_sum`). `position_ids` (B, T), restarting at 0
        where a sequence starts, make a packed window: each sequence attends only to itself, from position 0."""
        x = self.hidden(input_ids, kv_cache, position_ids)
        if labels is None:
            return self.lm_head(x)
        return self.head_loss_sum(x, labels)

    def head_loss_sum(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The head and the loss fused where the head is a plain linear, or PEFT's LoRA on one (its adapters' term
        made inside the fused loss, models/lora.py `adapted_head`); any other head (modules_to_save, DoRA) gives
        its whole logits to the chunked loss, so every trained parameter gets its gradient."""
        head = self.lm_head
        if type(head) is nn.Linear:
            return linear_loss_sum(x, head.weight, head.bias, labels)
        if not torch.compiler.is_compiling():
            from kubetrain.models.lora import adapted_head

            found = adapted_head(head, x)
            if found is not None:
                return linear_loss_sum(x, found[0].weight, found[0].bias, labels, found[1])
        return lm_loss_sum(head(x), labels)

    def hidden(self, input_ids: torch.Tensor, kv_cache: KVCache | None = None,
               position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The final norm's output (B, T, n_embd): what the head turns into logits."""
        start = kv_cache.length if kv_cache is not None else 0
        end = start + input_ids.shape[1]
        if end > self.config.block_size:
            raise ValueError(f"sequence of {end} tokens is longer than block_size {self.config.block_size}")
        if kv_cache is not None and start and input_ids.shape[1] > 1:
            raise ValueError("a filled KV cache takes one token per forward")
        cos, sin = self.rope_cos[start:end], self.rope_sin[start:end]
        documents = None
        if position_ids is not None:  # a packed window: rotary positions per sequence, (B, 1, T, head_dim)
            if kv_cache is not None:
                raise ValueError("a packed window (position_ids) is trained or evaluated, never sampled with a cache")
            cos, sin = self.rope_cos[position_ids].unsqueeze(1), self.rope_sin[position_ids].unsqueeze(1)
            documents = document_mask(position_ids, self.config.dropout if self.training else 0.0)
        x = self.drop(self.embed(input_ids))
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, None if kv_cache is None else (kv_cache, i), documents)
        if kv_cache is not None:
            kv_cache.length = end
        normed: torch.Tensor = self.norm(x)
        return normed

    def new_kv_cache(self) -> KVCache:
        """An empty cache for `forward(ids, kv_cache=...)` (sampling)."""
        return KVCache(self.config.n_layer)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameters, counting tied weights once; non_embedding leaves out the token embedding."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.embed.weight.numel() if non_embedding else n

    def flops_per_token(self) -> float:
        """Training FLOPs per token (forward + backward): 6 x matmul weights + attention (PaLM, app. B)."""
        c = self.config
        # The embedding lookup is no matmul, the lm_head is one (already counted when it is not tied).
        head = c.vocab_size * c.n_embd if c.tie_embeddings else 0
        matmul_params = self.num_params(non_embedding=True) + head
        return 6.0 * matmul_params + 12.0 * c.n_layer * c.n_embd * c.block_size

"""Packed windows: several sequences in one window, each attending only to itself and counting positions from 0.

A packed window carries `position_ids` (B, T) that restart at 0 where a sequence starts, the convention of Hugging
Face's padding-free collator and of transformers' `masking_utils` (`find_packed_sequence_indices`): a sequence ends
where the next position is not one more than the last. From them come the rotary positions and the attention mask
that keeps every token inside its own sequence (torchtune's block-causal mask, torchtitan's document masking).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kubetrain import torch_compat


def sequence_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) -> (B, T): which sequence of its window each token is in (0, 1, ...), read from where positions
    restart (the same rule as transformers' `find_packed_sequence_indices`, so both model kinds agree)."""
    before = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=before, dim=-1) != 1).cumsum(-1)


def block_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) bool, True where a query may attend to a key: earlier or same position, same sequence.

    One byte per (query, key) pair per window, shared by every head and every layer of a forward."""
    seq = sequence_ids(position_ids)
    t = seq.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=seq.device).tril()
    return ((seq[:, :, None] == seq[:, None, :]) & causal).unsqueeze(1)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: may attend) as SDPA's kernels take it: 0 or -inf in `dtype`. Made once per forward and
    shared by every layer: given the boolean one, SDPA's CPU kernel converts it in every call, and each layer's
    backward kept its own copy (measured: +20% of a tiny GPT's step)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


@dataclass
class DocumentMask:
    """How a forward's attention keeps each token in its sequence: an SDPA boolean mask, or a FlexAttention block
    mask and its kernel (where torch_compat finds them the fast path)."""

    dense: torch.Tensor | None = None  # (B, 1, T, T) bool, for SDPA
    block: Any = None  # a FlexAttention BlockMask
    kernel: Any = None  # flex_attention, compiled
    additive: torch.Tensor | None = None  # `dense` as SDPA's kernels take it: 0 or -inf in q's dtype

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float) -> torch.Tensor:
        """Attention of q, k, v (B, H, T, D) under the mask."""
        if self.kernel is not None:
            out: torch.Tensor = self.kernel(q, k, v, block_mask=self.block)
            return out
        assert self.dense is not None
        if self.additive is None or self.additive.dtype != q.dtype:
            self.additive = additive_mask(self.dense, q.dtype)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.additive, dropout_p=dropout)


def document_mask(position_ids: torch.Tensor, dropout: float = 0.0, flex: bool | None = None) -> DocumentMask:
    """The mask of a packed batch for every layer of one forward. FlexAttention where torch_compat offers it and no
    dropout is asked (it has none); `flex` forces the choice (tests: its mask on the CPU)."""
    found = torch_compat.flex_attention(position_ids.device)
    if flex is None:
        flex = found is not None and dropout == 0.0
    if not flex:
        return DocumentMask(dense=block_causal_mask(position_ids))
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    kernel, make_block_mask = found if found is not None else (flex_attention, create_block_mask)
    seq = sequence_ids(position_ids)

    def same_sequence_causal(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return (q >= kv) & (seq[b, q] == seq[b, kv])

    batch, t = seq.shape
    block = make_block_mask(same_sequence_causal, batch, None, t, t, device=position_ids.device)
    return DocumentMask(block=block, kernel=kernel)

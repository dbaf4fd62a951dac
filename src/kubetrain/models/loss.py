"""The language-model loss: mean next-token cross-entropy that never holds fp32 logits of a whole micro-batch.

Eager: cross-entropy in chunks of tokens with a hand-written backward, so no fp32 copy of the whole micro-batch's
logits is ever held (with bf16 autocast on a 50k vocabulary at 16 x 1024 tokens, that copy, its log-softmax and
their gradients were 7 GiB on an H200). Compiled: the plain formulation inside the compiled region, where Inductor
fuses the upcast into the softmax's reductions (torchtitan compiles its loss; nanoGPT computes it in `forward`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kubetrain.data.loader import IGNORE_INDEX

# fp32 elements of one chunk of logits: 2**24 (64 MiB) holds 333 tokens of a 50k vocabulary, 130 of 128k; a few
# dozen chunks per micro-batch cost a few hundred small kernels, nothing beside the model's
CHUNK_ELEMENTS = 1 << 24

def chunk_tokens(vocab: int, elements: int = CHUNK_ELEMENTS) -> int:
    """Tokens per chunk so that one chunk's fp32 logits hold about `elements` numbers."""
    return max(1, elements // max(1, vocab))


class ChunkedCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of (N, V) logits in any dtype against (N,) labels, IGNORE_INDEX left out, computed
    `chunk` rows at a time in fp32. Saves the logits (as they are) and one fp32 log-sum-exp per row; backward
    recomputes each chunk's softmax and writes the gradient in the logits' dtype."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
        n = logits.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        with torch.autocast(logits.device.type, enabled=False):  # fp32 on purpose, whatever autocast says
            for start in range(0, n, chunk):
                lse[start:start + chunk] = torch.logsumexp(logits[start:start + chunk].float(), dim=-1)
        counted = labels != IGNORE_INDEX
        safe = torch.where(counted, labels, 0)
        target = logits.gather(1, safe.unsqueeze(1)).squeeze(1).float()
        ctx.save_for_backward(logits, safe, counted, lse)
        ctx.chunk = chunk
        return ((lse - target) * counted).sum()

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, safe, counted, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        rows = torch.arange(logits.shape[0], device=logits.device)
        for start in range(0, logits.shape[0], ctx.chunk):
            part = slice(start, start + ctx.chunk)
            # d(lse - x_target)/dx = softmax(x) - onehot(target), for the rows that count (one fp32 chunk, in place)
            probs = logits[part].float().sub_(lse[part, None]).exp_()
            probs[rows[part] - start, safe[part]] -= 1.0
            probs.mul_((counted[part] * grad_total).unsqueeze(1))
            grad[part] = probs
        return grad, None, None


def lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy (fp32) over the positions that count (labels != IGNORE_INDEX).

    Compiled: F.cross_entropy on the upcast logits, which Inductor fuses; eager: `ChunkedCrossEntropy`."""
    flat, targets = logits.reshape(-1, logits.size(-1)), labels.reshape(-1)
    if torch.compiler.is_compiling():
        return F.cross_entropy(flat.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")
    total: torch.Tensor = ChunkedCrossEntropy.apply(flat, targets, chunk_tokens(flat.shape[-1]))
    return total


def counted_tokens(labels: torch.Tensor) -> torch.Tensor:
    """The positions a loss counts (at least 1, so a window of prompt only gives 0, not NaN)."""
    return (labels != IGNORE_INDEX).sum().clamp(min=1)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the positions that count; 0 for a batch with none (a prompt-only chat
    window), not NaN."""
    return lm_loss_sum(logits, labels) / counted_tokens(labels)

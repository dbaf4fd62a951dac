"""The language-model loss: next-token cross-entropy that never holds the whole micro-batch's logits in fp32, and,
with the head taken in, never holds them at all.

- `ChunkedCrossEntropy` (logits given): cross-entropy in chunks of tokens with a hand-written backward, so no fp32
  copy of the whole logits is ever held (with bf16 autocast on a 50k vocabulary at 16 x 1024 tokens, that copy, its
  log-softmax and their gradients were 7 GiB on an H200).
- `LinearCrossEntropy` (hidden states and the head's weight given): the head's matmul, the cross-entropy and their
  gradients chunk by chunk, so no tokens x vocab tensor exists beyond one chunk (Liger's and Apple's
  cut-cross-entropy idea; a Llama-3.2 vocabulary of 128,256 at 2,048 tokens is 1 GiB of fp32 logits, more with their
  gradient). Under bf16 autocast nothing of the weight's size is made per chunk: the weight's gradient is summed in
  fp32 straight from each chunk's fp32 softmax. With LoRA on the head its adapters' term is added chunk by chunk.
- Compiled: the plain formulation inside the compiled region, where Inductor fuses the upcast into the softmax's
  reductions (torchtitan compiles its loss; nanoGPT computes it in `forward`).

Both leave their inputs alone (out-of-place chunk math) and mask the rows that do not count with `where`, so a NaN
or inf in a masked row (a prompt token) reaches neither the loss nor a gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from kubetrain.data.loader import IGNORE_INDEX

# fp32 elements of one chunk of logits: 2**24 (64 MiB) holds 333 tokens of a 50k vocabulary, 130 of 128k; a few
# dozen chunks per micro-batch cost a few hundred small kernels, nothing beside the model's
CHUNK_ELEMENTS = 1 << 24


def chunk_tokens(vocab: int, elements: int = CHUNK_ELEMENTS) -> int:
    """Tokens per chunk so that one chunk's fp32 logits hold about `elements` numbers."""
    return max(1, elements // max(1, vocab))


def _targets(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(counted, safe): which rows count, and labels with IGNORE_INDEX replaced by a valid class (0)."""
    counted = labels != IGNORE_INDEX
    return counted, torch.where(counted, labels, 0)


def _softmax_minus_onehot(logits: torch.Tensor, lse: torch.Tensor, safe: torch.Tensor, counted: torch.Tensor,
                          grad_total: torch.Tensor) -> torch.Tensor:
    """d(lse - logit_target)/d(logits) * grad_total for one fp32 chunk, zero (never NaN) in rows that do not count.

    `logits` is only read: exp of the difference is a new tensor, which alone is then written."""
    grad = torch.exp(logits - lse.unsqueeze(1))
    grad[torch.arange(grad.shape[0], device=grad.device), safe] -= 1.0
    return torch.where(counted.unsqueeze(1), grad * grad_total, 0.0)


class ChunkedCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of (N, V) logits in any dtype against (N,) labels, IGNORE_INDEX left out, computed
    `chunk` rows at a time in fp32. Saves the logits (as they are) and one fp32 log-sum-exp per row; backward
    recomputes each chunk's softmax and writes the gradient in the logits' dtype."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
        n = logits.shape[0]
        counted, safe = _targets(labels)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        with torch.autocast(logits.device.type, enabled=False):  # fp32 on purpose, whatever autocast says
            for start in range(0, n, chunk):
                lse[start:start + chunk] = torch.logsumexp(logits[start:start + chunk].float(), dim=-1)
        target = logits.gather(1, safe.unsqueeze(1)).squeeze(1).float()
        ctx.save_for_backward(logits, safe, counted, lse)
        ctx.chunk = chunk
        return torch.where(counted, lse - target, 0.0).sum()

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, safe, counted, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        with torch.autocast(logits.device.type, enabled=False):
            for start in range(0, logits.shape[0], ctx.chunk):
                part = slice(start, start + ctx.chunk)
                grad[part] = _softmax_minus_onehot(logits[part].float(), lse[part], safe[part], counted[part],
                                                   grad_total)
        return grad, None, None


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in: autocast's where it is on (as nn.Linear would), else the input's."""
    device = hidden.device.type
    if hidden.is_floating_point() and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return hidden.dtype


LowRank = tuple[torch.Tensor, torch.Tensor]  # (u (N, r), B (V, r)): a term u @ B.T added to the logits


def _chunk_logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, low: LowRank | None) -> torch.Tensor:
    """One chunk's logits in fp32, from the matmuls in the inputs' dtype (the chunk's own tensor: free to write)."""
    out = h @ w.t() if b is None else torch.addmm(b, h, w.t())
    if low is not None:
        out.addmm_(low[0], low[1].t())
    return out.float()


def _softmax_minus_onehot_(logits: torch.Tensor, lse: torch.Tensor, safe: torch.Tensor, counted: torch.Tensor
                           ) -> torch.Tensor:
    """`_softmax_minus_onehot` (for an upstream gradient of 1) written over a chunk's own fp32 logits: no second
    chunk-sized tensor; the rows that do not count are filled with zero (a NaN there is overwritten, never summed)."""
    logits.sub_(lse.unsqueeze(1)).exp_()
    logits[torch.arange(logits.shape[0], device=logits.device), safe] -= 1.0
    return logits.masked_fill_(~counted.unsqueeze(1), 0.0)


def _head_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
               chunk: int, want: tuple[bool, ...], low_rank: LowRank | None = None) -> tuple[Any, ...]:
    """The summed loss of the head `hidden @ weight.T + bias (+ u @ B.T)` and, for the inputs `want` names (hidden,
    weight, bias, u, B), its gradients for an upstream gradient of 1, `chunk` rows at a time: each chunk's logits
    are made, reduced and dropped. The matmuls of the logits and of the hidden states' gradient run in autocast's
    dtype where it is on, like nn.Linear's; the weight's gradient is an fp32 sum made by fp32 addmm_ from the
    chunk's fp32 softmax, so under bf16 no weight-sized tensor is made per chunk (a half product and its fp32 copy
    were two); a bf16 copy of the weight is made once, as autocast makes one."""
    dtype = _compute_dtype(hidden)
    counted, safe = _targets(labels)
    n, device = hidden.shape[0], hidden.device
    f32 = torch.float32
    lse = torch.empty(n, dtype=f32, device=device)
    target = torch.empty(n, dtype=f32, device=device)
    u, big_b = low_rank if low_rank is not None else (None, None)
    grad_h = torch.empty_like(hidden) if want[0] else None
    grad_w = torch.zeros(weight.shape, dtype=f32, device=device) if want[1] else None
    grad_b = torch.zeros(weight.shape[0], dtype=f32, device=device) if bias is not None and want[2] else None
    grad_u = torch.empty_like(u) if u is not None and want[3] else None
    grad_big_b = torch.zeros(big_b.shape, dtype=f32, device=device) if big_b is not None and want[4] else None
    with torch.autocast(device.type, enabled=False):
        h, w = hidden.to(dtype), weight.to(dtype)
        b = None if bias is None else bias.to(dtype)
        low = None if u is None or big_b is None else (u.to(dtype), big_b.to(dtype))
        for start in range(0, n, chunk):
            part = slice(start, start + chunk)
            logits = _chunk_logits(h[part], w, b, None if low is None else (low[0][part], low[1]))
            lse[part] = torch.logsumexp(logits, dim=-1)
            target[part] = logits.gather(1, safe[part].unsqueeze(1)).squeeze(1)
            if not any(want):
                continue
            g = _softmax_minus_onehot_(logits, lse[part], safe[part], counted[part])  # fp32, over the logits
            g_low = g.to(dtype)  # the compute dtype's copy, for the matmuls that run in it (the same tensor in fp32)
            if grad_h is not None:
                grad_h[part] = g_low @ w
            if grad_w is not None:
                grad_w.addmm_(g.t(), h[part].float())
            if grad_b is not None:
                grad_b += g.sum(0)
            if grad_u is not None and low is not None:
                grad_u[part] = g_low @ low[1]
            if grad_big_b is not None and low is not None:
                grad_big_b.addmm_(g.t(), low[0][part].float())
    return torch.where(counted, lse - target, 0.0).sum(), grad_h, grad_w, grad_b, grad_u, grad_big_b


class LinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of `hidden @ weight.T + bias` ((N, d) hidden, (V, d) weight) against (N,) labels, `chunk`
    rows at a time, so no tokens x vocab tensor exists beyond one chunk. The loss is a scalar whose upstream gradient
    is a scalar too, so the gradients are made in the same pass (Liger's way: no second matmul to recompute the
    logits in backward), with g = softmax - onehot per chunk: grad_hidden = g @ W, grad_W += g.T @ h. Backward only
    scales them. Held: the gradients (hidden's size, and the weight's where the head trains), never the logits; a
    frozen head (LoRA) gets no weight gradient made.

    `low_in` (N, r) and `low_out` (V, r), where given, add `low_in @ low_out.T` to the logits: LoRA's adapters on
    the head (u = scale * A(dropout(hidden)), B), whose gradients are made alongside, without the merged weight.

    The weight's gradient is handed to autograd as it is, scaled in place, with no reference kept, so autograd
    takes it as the parameter's gradient without a copy: no second weight-sized tensor in backward. It can
    therefore be handed over once: a second backward (retain_graph) through a trained head is refused."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                labels: torch.Tensor, chunk: int, low_in: torch.Tensor | None = None,
                low_out: torch.Tensor | None = None) -> torch.Tensor:
        need = ctx.needs_input_grad
        want = (need[0], need[1], bias is not None and need[2], low_in is not None and need[5],
                low_out is not None and need[6])
        low = None if low_in is None or low_out is None else (low_in, low_out)
        total, *grads = _head_loss(hidden, weight, bias, labels, chunk, want, low)
        ctx.grads = grads  # on ctx, not saved for backward: backward hands the weight's over without a copy
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype,
                      None if low_in is None else low_in.dtype, None if low_out is None else low_out.dtype)
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grads: list[torch.Tensor | None] = ctx.grads
        if grads[1] is None and ctx.needs_input_grad[1]:
            raise RuntimeError("the fused head's weight gradient was handed over by an earlier backward: a second "
                               "backward through it (retain_graph) is not supported")
        out: list[torch.Tensor | None] = []
        for i, (grad, dtype) in enumerate(zip(grads, ctx.dtypes, strict=True)):
            if grad is None:
                out.append(None)
            elif i == 1:  # the weight's: scaled in place and given away (autograd steals a tensor nobody holds)
                grads[1] = None
                grad.mul_(grad_total)
                out.append(grad if grad.dtype == dtype else grad.to(dtype))
            else:  # hidden-, bias- or rank-sized: out of place, so a second backward reads them again
                out.append((grad * grad_total).to(dtype))
        return out[0], out[1], out[2], None, None, out[3], out[4]


def linear_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    labels: torch.Tensor, low_rank: LowRank | None = None) -> torch.Tensor:
    """Summed next-token cross-entropy (fp32) of the head `hidden @ weight.T + bias` over the positions that count,
    without the whole logits: the same number as `lm_loss_sum(F.linear(hidden, weight, bias), labels)`.
    `low_rank` (u (..., r) shaped like hidden, B (V, r)) adds u @ B.T to the logits (LoRA's adapters on the head).

    Compiled: that plain formulation, which Inductor fuses; eager: `LinearCrossEntropy`."""
    flat, targets = hidden.reshape(-1, hidden.size(-1)), labels.reshape(-1)
    low = None if low_rank is None else (low_rank[0].reshape(-1, low_rank[0].size(-1)), low_rank[1])
    if torch.compiler.is_compiling():
        logits = F.linear(flat, weight, bias)
        return lm_loss_sum(logits if low is None else logits + F.linear(low[0], low[1]), targets)
    chunk = chunk_tokens(weight.shape[0])
    if not torch.is_grad_enabled():  # evaluation: the loss alone, no gradients made
        loss: torch.Tensor = _head_loss(flat, weight, bias, targets, chunk, (False,) * 5, low)[0]
        return loss
    total: torch.Tensor = LinearCrossEntropy.apply(flat, weight, bias, targets, chunk,
                                                   *(low if low is not None else (None, None)))
    return total


def lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy (fp32) over the positions that count (labels != IGNORE_INDEX).

    Compiled: F.cross_entropy on the upcast logits, which Inductor fuses; eager: `ChunkedCrossEntropy`."""
    flat, targets = logits.reshape(-1, logits.size(-1)), labels.reshape(-1)
    if torch.compiler.is_compiling():
        return F.cross_entropy(flat.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")
    total: torch.Tensor = ChunkedCrossEntropy.apply(flat, targets, chunk_tokens(flat.shape[-1]))
    return total


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the positions that count; 0 for a batch with none (a prompt-only chat
    window), not NaN."""
    return lm_loss_sum(logits, labels) / (labels != IGNORE_INDEX).sum().clamp(min=1)

"""The language-model loss: next-token cross-entropy that never holds the whole micro-batch's logits in fp32, and,
with the head taken in, never holds them at all.

- `ChunkedCrossEntropy` (logits given): cross-entropy in chunks of tokens with a hand-written backward, so no fp32
  copy of the whole logits is ever held (with bf16 autocast on a 50k vocabulary at 16 x 1024 tokens, that copy, its
  log-softmax and their gradients were 7 GiB on an H200).
- `LinearCrossEntropy` (hidden states and the head's weight given): the head's matmul, the cross-entropy and their
  gradients chunk by chunk, so no tokens x vocab tensor exists beyond one chunk (Liger's and Apple's
  cut-cross-entropy idea; a Llama-3.2 vocabulary of 128,256 at 2,048 tokens is 1 GiB of fp32 logits, more with their
  gradient). `head_loss_kernel` picks torch's own fused kernel or an installed one where it is the faster.
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
from kubetrain.torch_compat import fused_linear_cross_entropy

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


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One chunk's logits in fp32, from the matmul in the inputs' dtype."""
    out = hidden @ weight.t() if bias is None else torch.addmm(bias, hidden, weight.t())
    return out.float()


def _head_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
               chunk: int, want: tuple[bool, bool, bool]
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The summed loss of the head `hidden @ weight.T + bias` and, for the inputs `want` names, its gradients (for an
    upstream gradient of 1), `chunk` rows at a time: each chunk's logits are made, reduced and dropped. The matmuls
    run in autocast's dtype where it is on, like nn.Linear's; the gradients of the weight and bias are fp32 sums."""
    dtype = _compute_dtype(hidden)
    counted, safe = _targets(labels)
    n = hidden.shape[0]
    lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
    target = torch.empty(n, dtype=torch.float32, device=hidden.device)
    grad_h = torch.empty_like(hidden) if want[0] else None
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want[1] else None
    grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if want[2] else None
    with torch.autocast(hidden.device.type, enabled=False):
        h, w = hidden.to(dtype), weight.to(dtype)
        b = None if bias is None else bias.to(dtype)
        one = torch.ones((), dtype=torch.float32, device=hidden.device)
        for start in range(0, n, chunk):
            part = slice(start, start + chunk)
            logits = _logits(h[part], w, b)
            lse[part] = torch.logsumexp(logits, dim=-1)
            target[part] = logits.gather(1, safe[part].unsqueeze(1)).squeeze(1)
            if not any(want):
                continue
            g = _softmax_minus_onehot(logits, lse[part], safe[part], counted[part], one).to(dtype)
            if grad_h is not None:
                grad_h[part] = g @ w
            if grad_w is not None and dtype == torch.float32:
                grad_w.addmm_(g.t(), h[part])  # no chunk-sized temporary of the weight's size
            elif grad_w is not None:
                grad_w += (g.t() @ h[part]).float()
            if grad_b is not None:
                grad_b += g.float().sum(0)
    return torch.where(counted, lse - target, 0.0).sum(), grad_h, grad_w, grad_b


class LinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of `hidden @ weight.T + bias` ((N, d) hidden, (V, d) weight) against (N,) labels, `chunk`
    rows at a time, so no tokens x vocab tensor exists beyond one chunk. The loss is a scalar whose upstream gradient
    is a scalar too, so the gradients are made in the same pass (Liger's way: no second matmul to recompute the
    logits in backward), with g = softmax - onehot per chunk: grad_hidden = g @ W, grad_W += g.T @ h. Backward only
    scales them. Saved: the gradients (hidden's size, and the weight's where the head trains), never the logits; a
    frozen head (LoRA) gets no weight gradient made."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                labels: torch.Tensor, chunk: int) -> torch.Tensor:
        want = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        total, grad_h, grad_w, grad_b = _head_loss(hidden, weight, bias, labels, chunk, want)
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.dtypes = weight.dtype, None if bias is None else bias.dtype
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_total: torch.Tensor
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None, None]:
        grad_h, grad_w, grad_b = ctx.saved_tensors  # out of place: a second backward (retain_graph) reads them again
        weight_dtype, bias_dtype = ctx.dtypes
        return (None if grad_h is None else grad_h * grad_total.to(grad_h.dtype),
                None if grad_w is None else (grad_w * grad_total).to(weight_dtype),
                None if grad_b is None else (grad_b * grad_total).to(bias_dtype), None, None)


def head_loss_kernel(device: torch.device) -> str:
    """Which fused head + loss runs on `device`: "torch" (F.linear_cross_entropy with its chunking options) where
    this torch has it and it was measured faster there than ours, else "kubetrain" (`LinearCrossEntropy`).

    Measured (bench/bench_loss.py): on the CPU torch's is 1.15x to 3x ours (bench/results/loss_cpu_2026-11-28.json,
    head_loss_cpu_2026-11-29.json). On CUDA nobody has measured it yet: until a GPU run of bench/bench_loss.py shows
    it faster, ours runs there too. Liger's and Apple's cut-cross-entropy kernels are optional extras named in
    docs/torch-versions.md; none is installed by kubetrain."""
    return "torch" if device.type in TORCH_KERNEL_FASTER_ON and fused_linear_cross_entropy() is not None \
        else "kubetrain"


# device types where torch's fused kernel was measured faster than ours (none yet; see head_loss_kernel)
TORCH_KERNEL_FASTER_ON: frozenset[str] = frozenset()


def linear_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy (fp32) of the head `hidden @ weight.T + bias` over the positions that count,
    without the whole logits: the same number as `lm_loss_sum(F.linear(hidden, weight, bias), labels)`.

    Compiled: that plain formulation, which Inductor fuses; eager: the kernel `head_loss_kernel` picks."""
    flat, targets = hidden.reshape(-1, hidden.size(-1)), labels.reshape(-1)
    if torch.compiler.is_compiling():
        return lm_loss_sum(F.linear(flat, weight, bias), targets)
    if head_loss_kernel(flat.device) == "torch":
        fused, options = fused_linear_cross_entropy()  # type: ignore[misc]
        summed: torch.Tensor = fused(flat, weight, targets, linear_bias=bias, reduction="sum",
                                     ignore_index=IGNORE_INDEX, options=options())
        return summed.float()
    chunk = chunk_tokens(weight.shape[0])
    if not torch.is_grad_enabled():  # evaluation: the loss alone, no gradients made
        return _head_loss(flat, weight, bias, targets, chunk, (False, False, False))[0]
    total: torch.Tensor = LinearCrossEntropy.apply(flat, weight, bias, targets, chunk)
    return total


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

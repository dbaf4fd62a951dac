"""The forward and loss a training step runs (and an evaluation): compiled as one graph when the run compiles.

The loss itself is models/loss.py's: eager, our GPT and Hugging Face models take the labels and run the head and
the loss together chunk by chunk (the whole logits never exist); compiled, the plain head and cross-entropy inside
the compiled region, which Inductor fuses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from kubetrain.models.gpt import GPT
from kubetrain.models.hf import HFCausalLM
from kubetrain.models.loss import lm_loss_sum


class LossStep(Protocol):
    """(input_ids, labels, position_ids) -> summed loss; position_ids (restarting at 0 at each sequence) for a
    packed batch, None for one sequence per window."""

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None = None,
                 /) -> torch.Tensor: ...


def takes_labels(model: nn.Module) -> bool:
    """Whether `model(input_ids, labels=labels)` gives its summed loss with the head fused in (our GPT, a Hugging
    Face model; also inside DDP, whose forward must run for its gradient hooks, and under PEFT's LoRA)."""
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    base = getattr(inner, "get_base_model", None)  # a PeftModel around our GPT
    inner = base() if callable(base) else inner
    return isinstance(inner, GPT | HFCausalLM)


def loss_step(model: nn.Module, compiled: bool, blocks_compiled: bool = False,
              backend: str | Callable[..., Any] = "inductor") -> LossStep:
    """(input_ids, labels) -> the summed loss of `model`'s logits (fp32): what a training step and an evaluation run.

    compiled: one graph of the model and its loss (one process; under DDP a graph per gradient bucket, see
    docs/architecture.md), or, where the blocks are already compiled in place (FSDP/HSDP, torchtitan's way), the
    loss compiled alone. Not compiled: the eager model with its head and loss fused (or, for a model that takes no
    labels, its logits and the chunked loss). `backend`: Dynamo's (tests use one that skips Inductor's code
    generation, minutes of C++ on a CPU).
    """
    fused = takes_labels(model)

    def forward_loss(input_ids: torch.Tensor, labels: torch.Tensor,
                     position_ids: torch.Tensor | None = None) -> torch.Tensor:
        packed = {} if position_ids is None else {"position_ids": position_ids}
        if fused:
            summed: torch.Tensor = model(input_ids, labels=labels, **packed)
            return summed
        return lm_loss_sum(model(input_ids, **packed), labels)

    if not compiled:
        return forward_loss
    if blocks_compiled:
        loss = torch.compile(lm_loss_sum, backend=backend)

        def blocks_then_loss(input_ids: torch.Tensor, labels: torch.Tensor,
                             position_ids: torch.Tensor | None = None) -> torch.Tensor:
            packed = {} if position_ids is None else {"position_ids": position_ids}
            return loss(model(input_ids, **packed), labels)

        return blocks_then_loss
    step: LossStep = torch.compile(forward_loss, backend=backend)
    return step

"""The forward and loss a training step runs (and an evaluation): compiled as one graph when the run compiles.

The loss itself is models/loss.py's (chunked when eager, plain inside the compiled region).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kubetrain.models.loss import lm_loss_sum

LossStep = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (input_ids, labels) -> summed loss


def loss_step(model: nn.Module, compiled: bool, blocks_compiled: bool = False, backend: str = "inductor"
              ) -> LossStep:
    """(input_ids, labels) -> the summed loss of `model`'s logits: what a training step and an evaluation run.

    compiled: one graph of the model and its loss (one process; under DDP, Dynamo's DDP optimizer splits it at the
    gradient buckets), or, where the blocks are already compiled in place (FSDP/HSDP, torchtitan's way), the loss
    compiled alone. Not compiled: the eager model and the chunked loss. `backend`: Dynamo's (tests use one that
    skips Inductor's code generation, minutes of C++ on a CPU).
    """

    def forward_loss(input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return lm_loss_sum(model(input_ids), labels)

    if not compiled:
        return forward_loss
    if blocks_compiled:
        loss = torch.compile(lm_loss_sum, backend=backend)
        return lambda input_ids, labels: loss(model(input_ids), labels)
    step: LossStep = torch.compile(forward_loss, backend=backend)
    return step

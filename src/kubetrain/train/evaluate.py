"""Validation loss and perplexity on a fixed set of windows, and text samples."""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
import torch.nn.functional as F
from torch import nn

from kubetrain.data.loader import IGNORE_INDEX, TokenWindows, val_batches
from kubetrain.distributed.setup import all_reduce_mean


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the positions that count (labels != IGNORE_INDEX).

    A batch with no such position (a chat window holding only prompt) gives 0, not NaN.
    """
    total = F.cross_entropy(
        logits.float().view(-1, logits.size(-1)), labels.view(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return total / (labels != IGNORE_INDEX).sum().clamp(min=1)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    windows: TokenWindows,
    batch_size: int,
    n_batches: int,
    device: torch.device,
    autocast: Callable[[], AbstractContextManager[None]],
    rank: int = 0,
    world: int = 1,
) -> float:
    """Mean validation loss over the same windows every time, averaged over ranks."""
    was_training = model.training
    model.eval()
    total, count = torch.zeros((), device=device), 0
    for batch in val_batches(windows, batch_size, n_batches, rank, world):
        batch = batch.to(device)
        with autocast():
            total += lm_loss(model(batch.input_ids), batch.labels)
        count += 1
    model.train(was_training)
    reshard = getattr(model, "reshard", None)
    if reshard is not None:  # FSDP2 keeps the root's weights gathered after a forward with no backward
        reshard()
    mean = total / max(count, 1)
    return float(all_reduce_mean(mean))


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))

"""Validation loss and perplexity on a fixed set of windows.

Collective-safe: every rank runs the same number of forwards (under FSDP each forward is a collective), a rank
with fewer windows pads with windows whose every label is ignored, and the loss is the token-weighted mean over
all windows: the same number as one process gets on the same weights, whatever the world size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import torch
from torch import nn

from kubetrain.data.loader import IGNORE_INDEX, Batch, TokenWindows, counted_tokens
from kubetrain.distributed import setup as dist
from kubetrain.train.loss import LossStep, loss_step


def eval_batches(n_windows: int, batch_size: int, n_eval: int, rank: int = 0, world: int = 1
                 ) -> list[list[int | None]]:
    """This rank's batches of validation window indices; None marks a padding window that counts for nothing.

    The first `n_eval` windows (all of them when there are fewer), whatever the world size and the micro-batch,
    dealt round-robin; every rank gets the same number of batches of the same sizes (`batch_size` windows at most).
    """
    total = min(n_windows, n_eval)
    per_rank = -(-total // world)
    mine: list[int | None] = list(range(rank, total, world))
    mine += [None] * (per_rank - len(mine))
    return [mine[i : i + batch_size] for i in range(0, per_rank, batch_size)]


def _batches(windows: TokenWindows, plan: list[list[int | None]]) -> Iterator[Batch]:
    for indices in plan:
        batch = windows.batch([0 if i is None else i for i in indices])
        pad = torch.tensor([i is None for i in indices])
        batch.labels[pad] = IGNORE_INDEX  # a padding window runs the forward but adds no token
        yield batch


@torch.no_grad()
def evaluate(
    model: nn.Module,
    windows: TokenWindows,
    batch_size: int,
    n_eval: int,
    device: torch.device,
    autocast: Callable[[], AbstractContextManager[None]],
    rank: int = 0,
    world: int = 1,
    loss_of: LossStep | None = None,
) -> float:
    """Token-weighted mean validation loss over the first `n_eval` windows (collective when distributed): the same
    number at any world size and micro-batch (`batch_size`, which only sets the windows per forward).

    `loss_of` (input_ids, labels, position_ids) -> summed loss: the training step's (compiled with it); default the
    eager model's.
    """
    loss_of = loss_of or loss_step(model, compiled=False)
    was_training = model.training
    model.eval()
    # float64 sums: the total over ranks is the same as one process's to ~1e-12, whatever the order (MPS has none)
    acc = torch.zeros(2, device=device, dtype=torch.float32 if device.type == "mps" else torch.float64)
    for batch in _batches(windows, eval_batches(windows.n_windows, batch_size, n_eval, rank, world)):
        batch = batch.to(device)
        with autocast():
            loss_sum = loss_of(batch.input_ids, batch.labels, batch.position_ids)
        acc[0] += loss_sum.to(acc.dtype)
        acc[1] += counted_tokens(batch.labels)
    model.train(was_training)
    reshard = getattr(model, "reshard", None)
    if reshard is not None:  # FSDP2 keeps the root's weights gathered after a forward with no backward
        reshard()
    acc = dist.all_reduce(acc)
    return float(acc[0] / acc[1].clamp(min=1))


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))

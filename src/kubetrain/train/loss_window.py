"""The train loss a log line shows: the window's summed loss over its counted tokens, every rank's.

Token-weighted like the step's own loss (train/accumulation.py), so it does not move with the batch split: the sums
live on the device (float64: exact counts, sums whose order hardly matters; MPS has none) and are reduced over
ranks only at log and save steps. A checkpoint holds every rank's sums; rank 0 resumes them, so a resume at any
world size logs the same loss.
"""

from __future__ import annotations

import torch

from kubetrain.distributed import setup as dist
from kubetrain.train.state import TrainState


class LossWindow:
    """This rank's summed loss and counted tokens since the last log line."""

    def __init__(self, device: torch.device, state: TrainState, resumes: bool) -> None:
        """`resumes`: this rank carries the window of `state` (rank 0). A checkpoint of an earlier version holds no
        tokens (its sum was of per-step means): that window is dropped."""
        window = state if resumes and state.window_tokens else TrainState()
        self.sums = torch.tensor([window.window_loss_sum, window.window_tokens], device=device,
                                 dtype=torch.float32 if device.type == "mps" else torch.float64)
        self.steps = window.window_steps

    def add(self, loss_sum: torch.Tensor) -> None:
        """A micro-batch's summed loss (no sync)."""
        self.sums[0] += loss_sum.detach().to(self.sums.dtype)

    def step_done(self, counted: torch.Tensor) -> None:
        """The step is over: its counted tokens on this rank (no sync)."""
        self.sums[1] += counted
        self.steps += 1

    def read_and_reset(self) -> float:
        """The window's loss over every rank (a collective: every rank calls it at the same log step)."""
        total = dist.all_reduce(self.sums)
        self.sums.zero_()
        self.steps = 0
        return float(total[0] / total[1].clamp(min=1))

    def save_into(self, state: TrainState) -> None:
        """Every rank's sums into `state` (a collective: every rank calls it at the same save)."""
        total = dist.all_reduce(self.sums)
        state.window_loss_sum, state.window_tokens, state.window_steps = float(total[0]), int(total[1]), self.steps

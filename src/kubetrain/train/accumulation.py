"""One optimizer step's accumulation window: its micro-batches, fetched up front, and the factor that makes their
summed losses one loss for the whole global batch.

The loss of a step is the sum over every micro-batch of the window and every rank, divided by the tokens counted
there (torchtitan does so; Hugging Face's `num_items_in_batch` fixed the same bug). Dividing each micro-batch by its
own count would weigh a micro-batch of 3 counted tokens (a chat window that is mostly prompt) like one of 60, and
what is trained would change with micro_batch_size, grad_accum_steps, the world size and `auto`'s choice.

The count is summed over ranks in one small all-reduce per step, started before the first forward and waited for
before the first backward; it stays on the device (no host sync). DDP and FSDP average gradients over ranks, so
each rank scales its summed loss by world_size / counted tokens, and the average is the global batch's gradient.

A window that counts no token on any rank (chat rows of prompt only) has nothing to learn from: the same count, read
on every rank, tells the step to leave the optimizer alone (train/nonfinite.py), with no other collective.
"""

from __future__ import annotations

import torch
import torch.distributed as td

from kubetrain.data.loader import Batch, TrainLoader, counted_tokens
from kubetrain.distributed import setup as dist


class Window:
    """The micro-batches of one step on this rank, and what the loss of each is scaled by."""

    def __init__(self, batches: list[Batch], world: int) -> None:
        self.batches = batches
        self.world = world
        # this rank's tokens (int64, on the device)
        self.counted = torch.stack([counted_tokens(b.labels) for b in batches]).sum()
        self.total = self.counted.clone()  # every rank's, once the all-reduce is done
        self._reduce: td.Work | None = dist.start_all_reduce_sum(self.total)
        self._scale: torch.Tensor | None = None

    @classmethod
    def fetch(cls, loader: TrainLoader, accum: int, device: torch.device, world: int) -> Window:
        """The next `accum` micro-batches on `device` (index tensors: small), their count's all-reduce started."""
        return cls([loader.next_batch().to(device) for _ in range(accum)], world)

    def _counted_everywhere(self) -> torch.Tensor:
        """The window's counted tokens over all ranks; the first call waits for the count's all-reduce (on NCCL the
        stream waits, not the host)."""
        if self._reduce is not None:
            self._reduce.wait()
            self._reduce = None
        return self.total

    def loss_scale(self) -> torch.Tensor:
        """world_size / the window's counted tokens over all ranks (at least 1: a window of prompt only gives 0)."""
        if self._scale is None:
            self._scale = self.world / self._counted_everywhere().clamp(min=1).to(torch.float32)
        return self._scale

    def empty(self) -> torch.Tensor:
        """Whether no rank counted a token in this window (a 0-dim bool on the device, no sync): the step has no
        data to learn from. The count is the loss's own all-reduced one, so every rank decides the same."""
        return self._counted_everywhere() == 0

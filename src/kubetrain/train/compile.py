"""torch.compile between phases: nothing left over. Whether a run compiles is hardware.compile_choice's; what is
compiled is applied elsewhere: the model and its loss as one graph in train/loss.py, each block in place under FSDP
in distributed/parallelize.py."""

from __future__ import annotations

import torch


def reset_compiled() -> None:
    """Drop every compiled graph and guard (a new phase compiles its own; the last phase's would only pile up)."""
    torch._dynamo.reset()

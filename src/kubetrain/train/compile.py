"""torch.compile between phases: nothing left over (compiling itself is applied in distributed.parallelize)."""

from __future__ import annotations

import torch


def reset_compiled() -> None:
    """Drop every compiled graph and guard (a new phase compiles its own; the last phase's would only pile up)."""
    torch._dynamo.reset()

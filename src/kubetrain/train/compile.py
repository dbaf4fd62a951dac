"""torch.compile applied from outside the model: per block under FSDP, and nothing left over between phases."""

from __future__ import annotations

import torch
from torch import nn


def compile_blocks(model: nn.Module, backend: str = "inductor") -> int:
    """Compile each transformer block in place; call it before fully_shard. Returns the blocks compiled.

    torchtitan (apply_compile in models/llama3/infra/parallelize.py) compiles every TransformerBlock after
    activation checkpointing and before FSDP: the blocks share one graph (compiled once, reused), and FSDP's
    all-gathers between blocks stay outside the compiled regions. In place (nn.Module.compile) rather than
    torch.compile(block), so parameter names keep no `_orig_mod.` and checkpoints load as before.
    """
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        return 0
    for block in blocks:
        block.compile(backend=backend)
    return len(blocks)


def reset_compiled() -> None:
    """Drop every compiled graph and guard (a new phase compiles its own; the last phase's would only pile up)."""
    torch._dynamo.reset()

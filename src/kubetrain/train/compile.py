"""torch.compile: whether a run compiles (`train.compile: auto` decides by the device), and nothing left over
between phases. What is compiled is applied elsewhere: the model and its loss as one graph in train/loss.py, each
block in place under FSDP in distributed/parallelize.py."""

from __future__ import annotations

import torch

from kubetrain.hardware import CompileChoice, choose_compile, triton_version


def compile_choice(requested: bool | str, device: torch.device) -> CompileChoice:
    """`choose_compile` for this process's device."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return choose_compile(requested, device.type, capability, triton_version() if device.type == "cuda" else None)


def reset_compiled() -> None:
    """Drop every compiled graph and guard (a new phase compiles its own; the last phase's would only pile up)."""
    torch._dynamo.reset()

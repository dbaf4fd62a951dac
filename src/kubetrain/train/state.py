"""What the loop carries across a resume: its counters, RNG streams, and the model/optimizer state it saves."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as td
from torch import nn

from kubetrain import checkpoint
from kubetrain.checkpoint.sharded import load_optimizer as load_sharded_optimizer
from kubetrain.checkpoint.sharded import load_optimizer_shards, load_whole_optimizer
from kubetrain.errors import IncompatibleCheckpointError


@dataclass
class TrainState:
    """Everything besides weights and optimizer that a resume needs."""

    step: int = 0
    tokens: int = 0
    best_val_loss: float | None = None  # the lowest of every evaluation
    best_saved_val_loss: float | None = None  # the val loss of the checkpoint `best` names
    last_train_loss: float | None = None
    last_val_loss: float | None = None
    # The current logging window over every rank: its summed loss, steps and counted tokens, so a resumed run logs
    # the same token-weighted loss. (A checkpoint of an earlier version holds no tokens: its window is dropped.)
    window_loss_sum: float = 0.0
    window_steps: int = 0
    window_tokens: int = 0
    # steps that changed no weight: a loss or gradient that was not finite (fp16: also a gradient that overflowed)
    skipped_steps: int = 0
    # ... of those, the ones in a row up to this step: a stop in the middle of them resumes the count, so only
    # train.max_nonfinite_steps in a row fail a run, across restarts too
    nonfinite_streak: int = 0
    # steps whose window counted no token (every label masked, on every rank): no optimizer step, no decay
    empty_steps: int = 0

    def improves_best_saved(self, evaluated_step: int) -> bool:
        """Whether a checkpoint of this step becomes `best`: evaluated at this step, with a lower val loss than
        every saved checkpoint's."""
        return evaluated_step == self.step and self.last_val_loss is not None and (
            self.best_saved_val_loss is None or self.last_val_loss < self.best_saved_val_loss)


def unwrap(model: nn.Module) -> nn.Module:
    inner = getattr(model, "module", model)  # DDP
    return getattr(inner, "_orig_mod", inner)  # torch.compile


def rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def gather_rng(world: int) -> list[Any]:
    """The RNG state of every rank (rank order), so each rank resumes its own stream."""
    mine = rng_state()
    if world == 1:
        return [mine]
    everyone: list[Any] = [None] * world
    td.all_gather_object(everyone, mine)
    return everyone


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint stores: every weight, or only the trainable ones when some are frozen (LoRA adapters)."""
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    if len(trainable) == len(list(model.parameters())):
        return model.state_dict()
    return {n: t for n, t in model.state_dict().items() if n in trainable}


def weight_shapes(model: nn.Module) -> dict[str, list[int]]:
    """Name -> shape of each weight a checkpoint stores (tied weights once, under their first name), the whole
    shape also when the model is sharded."""
    from kubetrain.distributed.parallelize import is_sharded, tied_aliases

    if not is_sharded(model):
        return {k: list(v.shape) for k, v in checkpoint.unique_tensors(model_state(model)).items()}
    aliases = tied_aliases(model)
    return {k: list(v.shape) for k, v in model_state(model).items() if k not in aliases}


def load_optimizer(
    model: nn.Module, optimizer: torch.optim.Optimizer, ckpt: checkpoint.Checkpoint, trainer: dict[str, Any],
    sharded: bool,
) -> None:
    if trainer.get("optimizer") is not None:
        if sharded:  # a whole-model checkpoint (one process, DDP) resumed under FSDP: each rank keeps its part
            load_whole_optimizer(model, optimizer, trainer["optimizer"])
        else:
            optimizer.load_state_dict(trainer["optimizer"])
    elif ckpt.sharded:  # DCP shards reshard to any world: FSDP at another size, DDP, one process
        load_optimizer_shards(model, optimizer, ckpt.path)
    elif sharded:  # an FSDP checkpoint of an earlier version: the optimizer alone in optimizer/
        load_sharded_optimizer(model, optimizer, ckpt.path)
    else:
        raise IncompatibleCheckpointError(f"{ckpt.path} holds a sharded (FSDP) optimizer; resume it with FSDP")


def load_model_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load checkpointed weights; shapes and names were checked by checkpoint.check_compatible."""
    model.load_state_dict(state, strict=False)


def optimizer_steps(optimizer: torch.optim.Optimizer) -> int:
    """Updates the optimizer really made: AdamW's per-parameter step count, which a skipped step leaves alone.

    (The fused kernels add one and take it back when the scaler found inf/nan gradients.) Reading it
    synchronises with the GPU: call it at log and save time, not every step.
    """
    for group in optimizer.param_groups:
        for p in group["params"]:
            step = optimizer.state.get(p, {}).get("step")
            if step is not None:
                return int(step)
    return 0

"""A step whose loss or gradients are not finite changes no weight and no optimizer state; a run whose steps stay so
stops, naming a checkpoint whose weights gave a finite loss.

As GradScaler's found-inf, on the device with no host sync per step: a micro-batch whose summed loss is not finite
backpropagates NaN (its loss is scaled by NaN), so the gradients the ranks average are NaN on every rank; the total
gradient norm, the same on every rank, then decides, and the fused AdamW skips the step in its kernel
(torch_compat.step_unless_found_inf). Under fp16 the GradScaler decides the same way (and backs off its scale).

The count of such steps in a row lives on the device and is read only at the steps that log, evaluate or save (one
all-reduce there). While it is not 0 nothing is evaluated or saved; a save also refuses weights or optimizer state
that are not finite (an update that overflowed), so no checkpoint holds them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.distributed as td
from torch import nn

from kubetrain import checkpoint
from kubetrain.config.schema import Config
from kubetrain.errors import RepeatableFailure
from kubetrain.torch_compat import step_unless_found_inf
from kubetrain.train.state import optimizer_steps


def grad_norm(parameters: list[nn.Parameter], clip: float) -> torch.Tensor:
    """The total gradient norm over every rank (clipping to `clip` first when it is above 0), a plain tensor."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if clip > 0:
        norm = torch.nn.utils.clip_grad_norm_([p for p in parameters if p.grad is not None], clip)
    else:
        norm = torch.nn.utils.get_total_norm(grads)
    full = getattr(norm, "full_tensor", None)  # FSDP: a DTensor of the shards' partial norms
    return full() if full is not None else norm


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # FSDP: this rank's shard
    return to_local() if to_local is not None else t


class NonFiniteGuard:
    """Skips the steps whose loss or gradients are not finite, and counts them (on any micro-batch, on any rank)."""

    def __init__(self, cfg: Config, device: torch.device, ckpt_root: Path, settle: Callable[[], object],
                 step: int, optimizer: torch.optim.Optimizer) -> None:
        self.limit = cfg.train.max_nonfinite_steps
        self.clip = cfg.train.grad_clip
        self.every = (cfg.train.log_every_steps, cfg.eval.every_steps, cfg.checkpoint.every_steps)
        self.ckpt_root, self.settle = ckpt_root, settle  # settle: waits for the save in flight
        self.streak = torch.zeros((), dtype=torch.int64, device=device)  # steps in a row, up to the last one
        self.bad = torch.zeros((), dtype=torch.bool, device=device)  # this step so far
        self.counted_at = (step, optimizer_steps(optimizer))  # (step, optimizer steps taken) when last counted

    def loss_to_backward(self, loss_sum: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """A micro-batch's summed loss times `scale`; NaN when it is not finite, so every gradient is NaN (no sync)."""
        finite = torch.isfinite(loss_sum.detach())
        self.bad |= ~finite
        return loss_sum * torch.where(finite, scale, torch.full_like(scale, float("nan")))

    def step(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
             parameters: Iterable[nn.Parameter]) -> None:
        """Clip, then step unless the gradients are not finite; the streak grows by one or starts again (no sync)."""
        params = [p for p in parameters if p.grad is not None]
        if scaler.is_enabled():  # fp16: an overflow is the scaler's to skip; the streak counts non-finite losses
            if self.clip > 0:
                scaler.unscale_(optimizer)
                grad_norm(params, self.clip)
            scaler.step(optimizer)
            scaler.update()
        else:
            bad = ~torch.isfinite(grad_norm(params, self.clip))
            self.bad |= bad
            step_unless_found_inf(optimizer, bad.to(torch.float32))
        self.streak.add_(1).mul_(self.bad)
        self.bad.zero_()

    def skipped_since_counted(self, step: int, optimizer: torch.optim.Optimizer) -> int:
        """The steps since the last count that changed nothing: read from the optimizer's own step count, which a
        skipped step leaves alone (a host sync: call it at log and save time only)."""
        taken = optimizer_steps(optimizer)
        skipped = (step - self.counted_at[0]) - (taken - self.counted_at[1])
        self.counted_at = (step, taken)
        return skipped

    def finite(self, step: int, last: bool) -> bool:
        """At a step that logs, evaluates or saves (every rank): False while steps are being skipped, which puts off
        evaluating and saving; RepeatableFailure (exit 1, no restart) once that has lasted `train.max_nonfinite_steps`
        steps, or at the last step (`last`: the end of the run, or a stop), whose weights would be saved. Other
        steps: True."""
        if not last and all(step % every for every in self.every):
            return True
        streak = self.streak.clone()
        if td.is_initialized() and td.get_world_size() > 1:
            td.all_reduce(streak, op=td.ReduceOp.MAX)
        n = int(streak)
        if n >= self.limit or (last and n > 0):
            first = step - n + 1
            self.settle()  # a background save of a step before `first` is one to name
            raise RepeatableFailure(f"the loss or its gradients were not finite (NaN or inf) for {n} steps in a row, "
                                    f"since step {first}: stopped at step {step} (those steps changed no weight); "
                                    f"{self.last_good(first)}")
        return n == 0

    def last_good(self, first_bad: int) -> str:
        """The newest checkpoint whose weights gave a finite loss, for the one line that stops the run.

        The loss of step k is computed on the weights step k-1 saved: the checkpoint of step `first_bad - 1` holds the
        weights whose loss was not finite, so the newest one before it is named."""
        proven = [p for p in checkpoint.complete_checkpoints(self.ckpt_root)
                  if int(p.name.split("-")[1]) < first_bad - 1]
        if not proven:
            return ("no checkpoint whose weights gave a finite loss was saved before it: lower train.lr, or check the "
                    "data")
        return (f"the newest checkpoint whose weights gave a finite loss is {proven[-1]} (resume from it with "
                f"--resume {proven[-1]}, with a lower train.lr, or check the data)")

    def savable(self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int, last: bool,
                say: Callable[[str], None]) -> bool:
        """Whether every weight and optimizer tensor is finite on every rank (a host sync: at save time only).

        Not finite (an update overflowed): a periodic save is left out with a warning (the next step's loss is not
        finite, and counts); the last save of a run (`last`) raises RepeatableFailure naming a checkpoint to resume.
        """
        tensors = [_local(p) for p in model.parameters()]
        tensors += [_local(t) for state in optimizer.state.values() for t in state.values()
                    if isinstance(t, torch.Tensor) and t.is_floating_point()]
        device = self.streak.device
        ok = torch.stack([torch.isfinite(t).all().to(device) for t in tensors]).all().to(torch.int32)
        if td.is_initialized() and td.get_world_size() > 1:
            td.all_reduce(ok, op=td.ReduceOp.MIN)
        if bool(ok):
            return True
        if last:
            self.settle()
            raise RepeatableFailure(f"the weights of step {step} are not finite (NaN or inf): an update overflowed; "
                                    f"{self.last_good(step + 1)}")
        say(f"warning: step {step} is not saved: its weights or optimizer state are not finite (NaN or inf)")
        return False

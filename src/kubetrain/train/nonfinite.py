"""A step whose loss or gradients are not finite changes no weight and no optimizer state; a run whose steps stay so
stops, naming a checkpoint whose weights gave a finite loss. A step over a window with no counted token changes
nothing either.

As GradScaler's found-inf, on the device with no host sync per step: a micro-batch whose summed loss is not finite
backpropagates NaN (its loss is scaled by NaN), so the gradients the ranks average are NaN on every rank; the total
gradient norm, the same on every rank, then decides, and the fused AdamW skips the step in its kernel
(torch_compat.step_unless_found_inf). Under fp16 the gradients are unscaled first, so the same norm sees what the
scaler sees: its overflows are skipped steps like any other (and the scaler backs off its scale).

The count of such steps in a row lives on the device and is read only at the steps that log, evaluate or save (one
all-reduce there). While it is not 0 periodic evaluations and saves wait; the last save of a run, or the one a stop
asks for, is made anyway (a skipped step changed no weight, so it holds the weights of the last step taken), and
only `train.max_nonfinite_steps` in a row fail the run. A save also refuses weights or optimizer state that are not
finite (an update that overflowed), so no checkpoint holds them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.distributed as td
from torch import nn

from kubetrain import checkpoint
from kubetrain.checkpoint import diverged
from kubetrain.config.schema import Config
from kubetrain.distributed import setup as dist
from kubetrain.errors import RepeatableFailure
from kubetrain.torch_compat import step_unless_found_inf
from kubetrain.train.state import TrainState


def grad_norm(parameters: list[nn.Parameter], clip: float) -> torch.Tensor:
    """The total gradient norm over every rank (clipping to `clip` first when it is above 0), a plain tensor."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if clip > 0:
        norm = torch.nn.utils.clip_grad_norm_([p for p in parameters if p.grad is not None], clip)
    else:
        norm = torch.nn.utils.get_total_norm(grads)
    full = getattr(norm, "full_tensor", None)  # FSDP: a DTensor of the shards' partial norms
    return full() if full is not None else norm


class NonFiniteGuard:
    """Skips the steps whose loss or gradients are not finite, and counts them (on any micro-batch, on any rank); skips
    and counts the steps whose window counted no token."""

    def __init__(self, cfg: Config, device: torch.device, ckpt_root: Path, settle: Callable[[], object],
                 state: TrainState) -> None:
        self.limit = cfg.train.max_nonfinite_steps
        self.clip = cfg.train.grad_clip
        self.every = (cfg.train.log_every_steps, cfg.eval.every_steps, cfg.checkpoint.every_steps)
        self.ckpt_root, self.settle = ckpt_root, settle  # settle: waits for the save in flight
        # steps skipped in a row as not finite, up to the last one (a stop's checkpoint carries it over a restart)
        self.streak = torch.tensor(state.nonfinite_streak, dtype=torch.int64, device=device)
        self.bad = torch.zeros((), dtype=torch.bool, device=device)  # this step so far
        self.skipped = torch.zeros(2, dtype=torch.int64, device=device)  # since last counted: (not finite, empty)
        self.streak_seen = state.nonfinite_streak  # the streak as `finite` last read it

    def loss_to_backward(self, loss_sum: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """A micro-batch's summed loss times `scale`; NaN when it is not finite, so every gradient is NaN (no sync)."""
        finite = torch.isfinite(loss_sum.detach())
        self.bad |= ~finite
        return loss_sum * torch.where(finite, scale, torch.full_like(scale, float("nan")))

    def step(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
             parameters: Iterable[nn.Parameter], empty: torch.Tensor) -> None:
        """Clip, then step unless the gradients are not finite or the window counted no token (`empty`, the same on
        every rank); the streak grows by one, starts again, or (an empty window) stays (no sync)."""
        params = [p for p in parameters if p.grad is not None]
        if scaler.is_enabled():  # fp16: the norm of the unscaled gradients sees the overflows the scaler finds
            scaler.unscale_(optimizer)
        self.bad |= ~torch.isfinite(grad_norm(params, self.clip))
        empty = empty & ~self.bad
        # no data: AdamW would still move every weight (its momentum, its decay) and count a step
        step_unless_found_inf(optimizer, (self.bad | empty).to(torch.float32))
        if scaler.is_enabled():
            scaler.update()  # backs off the scale after an overflow (found by unscale_ above)
        self.skipped += torch.stack([self.bad, empty])
        self.streak.copy_(torch.where(self.bad, self.streak + 1, torch.where(empty, self.streak, 0)))
        self.bad.zero_()

    def count_into(self, state: TrainState) -> None:
        """The steps skipped since the last count, as not finite and as empty, into `state`'s counters, and the
        streak (a host sync: call it at log and save time only)."""
        nonfinite, empty, streak = torch.cat([self.skipped, self.streak.view(1)]).tolist()
        self.skipped.zero_()
        state.skipped_steps += nonfinite
        state.empty_steps += empty
        state.nonfinite_streak = streak

    def finite(self, step: int, last: bool) -> bool:
        """At a step that logs, evaluates or saves, and at the last one (`last`: the end of the run, or a stop; every
        rank): whether no step is being skipped now; False puts off periodic evaluations and saves (the last save is
        made anyway). RepeatableFailure (exit 1, no restart) once `train.max_nonfinite_steps` steps in a row were
        skipped. Other steps: True, with no sync."""
        if not last and all(step % every for every in self.every):
            return True
        n = self.streak_seen = int(dist.all_reduce(self.streak, td.ReduceOp.MAX))
        if n >= self.limit:
            first = step - n + 1
            self.settle()  # a background save of a step before `first` is one to name
            self.mark_diverged(first)
            raise RepeatableFailure(f"the loss or its gradients were not finite (NaN or inf) for {n} steps in a row, "
                                    f"since step {first}: stopped at step {step} (those steps changed no weight); "
                                    f"{self.last_good(first)}")
        return n == 0

    def mark_diverged(self, first_bad: int) -> None:
        """List the checkpoints whose weights led to the non-finite steps (rank 0), so `--resume auto` passes them by
        (checkpoint/diverged.py): resuming `latest` would fail the same way."""
        if td.is_initialized() and td.get_rank() != 0:
            return
        led_there = [p.name for p in checkpoint.complete_checkpoints(self.ckpt_root)
                     if int(p.name.split("-")[1]) >= first_bad - 1]
        diverged.mark(self.ckpt_root, led_there)

    def last_good(self, first_bad: int) -> str:
        """The newest checkpoint whose weights gave a finite loss, and the command that goes on from it, for the one
        line that stops the run.

        The loss of step k is computed on the weights step k-1 saved: the checkpoint of step `first_bad - 1` holds the
        weights whose loss was not finite, so the newest one before it is named."""
        proven = [p for p in checkpoint.complete_checkpoints(self.ckpt_root)
                  if int(p.name.split("-")[1]) < first_bad - 1]
        if not proven:
            return ("no checkpoint whose weights gave a finite loss was saved before it: run the same command with "
                    "--set run.name=NEW and a lower --set train.lr=..., or check the data")
        return (f"the newest checkpoint whose weights gave a finite loss is {proven[-1]}: run the same command with "
                f"a lower --set train.lr=... (--resume auto goes on from {proven[-1].name}, passing by the "
                "checkpoints after it), or check the data")

    def savable(self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int, last: bool,
                say: Callable[[str], None]) -> bool:
        """Whether every weight and optimizer tensor is finite on every rank (a host sync: at save time only).

        Not finite (an update overflowed): a periodic save is left out with a warning (the next step's loss is not
        finite, and counts); the last save of a run (`last`) raises RepeatableFailure naming a checkpoint to resume.
        """
        tensors = [dist.local_part(p) for p in model.parameters()]
        tensors += [dist.local_part(t) for state in optimizer.state.values() for t in state.values()
                    if isinstance(t, torch.Tensor) and t.is_floating_point()]
        device = self.streak.device
        ok = torch.stack([torch.isfinite(t).all().to(device) for t in tensors]).all().to(torch.int32)
        if bool(dist.all_reduce(ok, td.ReduceOp.MIN)):
            return True
        if last:
            self.settle()
            raise RepeatableFailure(f"the weights of step {step} are not finite (NaN or inf): an update overflowed; "
                                    f"{self.last_good(step + 1)}")
        say(f"warning: step {step} is not saved: its weights or optimizer state are not finite (NaN or inf)")
        return False

"""Stop a run whose loss stays NaN or inf, naming the step and the last checkpoint saved before it went bad.

The count of non-finite steps in a row lives on the device and is read only at the steps that log, evaluate or
save (one all-reduce there): no host-device sync on the other steps. While the loss is not finite nothing is
evaluated or saved, so no checkpoint of the damaged weights replaces a good one.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as td

from kubetrain import checkpoint
from kubetrain.config.schema import Config
from kubetrain.errors import RepeatableFailure


class NonFiniteLoss:
    """Counts the steps in a row whose loss was not finite (on any micro-batch, on any rank)."""

    def __init__(self, cfg: Config, device: torch.device, ckpt_root: Path, settle: Callable[[], object]) -> None:
        self.limit = cfg.train.max_nonfinite_steps
        self.every = (cfg.train.log_every_steps, cfg.eval.every_steps, cfg.checkpoint.every_steps)
        self.ckpt_root, self.settle = ckpt_root, settle  # settle: waits for the save in flight
        self.streak = torch.zeros((), dtype=torch.int64, device=device)  # steps in a row, up to the last one
        self.bad = torch.zeros((), dtype=torch.bool, device=device)  # this step so far

    def observe(self, loss: torch.Tensor) -> None:
        """A micro-batch's loss (no sync)."""
        self.bad |= ~torch.isfinite(loss.detach())

    def step_done(self) -> None:
        """The step is over: the streak grows by one, or starts again at 0 (no sync)."""
        self.streak.add_(1).mul_(self.bad)
        self.bad.zero_()

    def finite(self, step: int, last: bool) -> bool:
        """At a step that logs, evaluates or saves (every rank): False while the loss is not finite, which puts off
        evaluating and saving; RepeatableFailure (exit 1, no restart) once it has lasted `train.max_nonfinite_steps`
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
            raise RepeatableFailure(f"the loss was not finite (NaN or inf) for {n} steps in a row, since step {first}: "
                                 f"stopped at step {step}; {self.last_good(first)}")
        return n == 0

    def last_good(self, first_bad: int) -> str:
        """The newest checkpoint saved before step `first_bad`, for the one line that stops the run."""
        before = [p for p in checkpoint.complete_checkpoints(self.ckpt_root) if int(p.name.split("-")[1]) < first_bad]
        if not before:
            return "no checkpoint was saved before it: lower train.lr, or check the data"
        return f"the last good checkpoint is {before[-1]} (a resume starts from it: lower train.lr, or check the data)"

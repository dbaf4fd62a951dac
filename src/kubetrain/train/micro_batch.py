"""The batch a run trains with: `train.global_batch_size` kept by grad accumulation, and `micro_batch_size: auto`.

`resolve_batch` is the one boundary where `auto` becomes a number and grad_accum_steps is derived from the global
batch: the launch plan (train/launch_plan.py, the worker's and the launcher's), `kubetrain doctor` and `k8s render`
call it, and every reader after it (the loader, the memory estimate, the loop) sees ints.

`auto` picks, among the micro-batches that divide this process's share of the global batch (so accumulation is
whole), the largest whose memory estimate (`memory.estimate_on`, for the run's layout, with the accumulation that
candidate trains with) fits the device: the pure choice is train/micro_batch_choice.py's `choose`. The Trainer
then confirms it with one forward and backward on the real model (`confirm`), with gradient-sized buffers in place
when it accumulates, stepping down to the next smaller candidate on out-of-memory, as DeepSpeed's and Lightning's
batch-size finders do; the global batch stays, grad_accum_steps grows. Here: the config plumbing, the estimate's
questions, the confirming step and its collectives.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from kubetrain.config.schema import Config
from kubetrain.data.loader import TokenWindows, TrainLoader, counted_tokens
from kubetrain.distributed import setup as dist
from kubetrain.errors import TrainingFailed, UserInputError
from kubetrain.memory import Layout, estimate_on
from kubetrain.train.device import is_out_of_memory
from kubetrain.train.loss import LossStep, loss_step
from kubetrain.train.micro_batch_choice import (
    GIB,
    HEADROOM,
    MicroBatchChoice,
    accum_steps,
    candidates,
    choose,
    per_process_batch,
    size_text,
)

__all__ = ["MicroBatchChoice", "budget_for", "confirm", "confirm_on_model", "planning_config", "resolve_batch",
           "step_down", "with_batch"]

def with_batch(cfg: Config, micro_batch: int, grad_accum: int) -> Config:
    """A copy of `cfg` that trains with this micro-batch and accumulation (validated as a user's value would be)."""
    train = cfg.train.model_dump() | {"micro_batch_size": micro_batch, "grad_accum_steps": grad_accum}
    return cfg.model_copy(update={"train": type(cfg.train).model_validate(train)})


# --- the boundary: auto -> an int, the global batch -> grad_accum_steps --------------------------------------


def resolve_batch(cfg: Config, layout: Layout, device: torch.device, budget: int | None = None
                  ) -> tuple[Config, MicroBatchChoice | None]:
    """`cfg` with an int micro-batch and grad_accum_steps derived from train.global_batch_size (when set), and what
    `auto` chose (None when the config gave a number). `budget`: the bytes `auto` may plan for (default:
    train.memory_budget_gib, else HEADROOM of what `device` has free now)."""
    t = cfg.train
    if t.global_batch_size is None:  # the validator lets `auto` through only with a global batch
        return cfg, None
    per_process = per_process_batch(t.global_batch_size, layout.world_size)
    choice = None
    if t.micro_batch_size == "auto":
        choice = choose_by_estimate(cfg, layout, device, candidates(per_process), budget)
        micro = choice.micro_batch
    else:
        micro = t.micro_batch_size
    # the global batch is the more specific of the two: a grad_accum_steps given too (a preset's) gives way to it
    return with_batch(cfg, micro, accum_steps(per_process, micro, t.global_batch_size, layout.world_size)), choice


def choose_by_estimate(cfg: Config, layout: Layout, device: torch.device, sizes: Sequence[int],
                       budget: int | None = None) -> MicroBatchChoice:
    """`choose` with the memory estimate of `cfg` at each size, on `device` for `layout`, against the budget. Each
    size is estimated with the accumulation it would train with: from a second micro-batch on, whole gradients
    exist beside its activations."""
    budget, budget_from = budget_for(cfg, device, budget)
    per_process = per_process_batch(cfg.train.global_batch_size or max(sizes), layout.world_size)

    def need(size: int) -> int:
        est = estimate_on(with_batch(cfg, size, max(1, per_process // size)), layout, device)
        if isinstance(est, str):
            raise UserInputError(f"train.micro_batch_size auto chooses by the memory estimate, which is not known "
                                 f"here: {est}; set a number")
        return est.device_need

    return choose(sizes, need, budget, budget_from)


def budget_for(cfg: Config, device: torch.device, budget: int | None = None) -> tuple[int, str]:
    """(bytes, where they come from): the budget given, train.memory_budget_gib, or HEADROOM of the free memory."""
    if budget is not None:
        return budget, "the budget given"
    if cfg.train.memory_budget_gib is not None:
        return int(cfg.train.memory_budget_gib * GIB), "train.memory_budget_gib"
    from kubetrain.hardware import device_info

    free = device_info(device).memory_free
    if free is None:
        raise UserInputError(f"train.micro_batch_size auto needs the memory free on {device.type}, which is not "
                             "known here; set train.memory_budget_gib")
    return int(free * HEADROOM), f"{HEADROOM:.0%} of the {size_text(free)} free on {device.type}"


def planning_config(cfg: Config, layout: Layout) -> Config:
    """`cfg` for planning away from the device that will train it (`k8s render`): grad_accum_steps derived, and
    `auto` at its smallest candidate: what must fit at least (the pods choose on their own devices)."""
    t = cfg.train
    if t.global_batch_size is None:
        return cfg
    per_process = per_process_batch(t.global_batch_size, layout.world_size)
    micro = candidates(per_process)[-1] if t.micro_batch_size == "auto" else t.micro_batch_size
    return with_batch(cfg, micro, accum_steps(per_process, micro, t.global_batch_size, layout.world_size))


# --- the confirming step ---------------------------------------------------------------------------------------


def step_down(attempt: Callable[[int], None], sizes: Sequence[int], agree: Callable[[int], int] = lambda ok: ok
              ) -> tuple[int, list[int]]:
    """The first of `sizes` (largest first) at which `attempt` runs without running out of memory on every rank
    (`agree`: the minimum over the ranks), and the sizes that did not. Any other error is raised."""
    failed: list[int] = []
    for size in sizes:
        ok = 1
        try:
            attempt(size)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not is_out_of_memory(e):
                raise
            ok = 0  # the error (and the tensors its traceback holds) is dropped before the memory is freed
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if agree(ok):
            return size, failed
        failed.append(size)
    raise TrainingFailed(f"out of memory in a training step even at micro-batch {sizes[-1]} (tried "
                         f"{', '.join(map(str, failed))}); lower model.block_size, set "
                         "model.gradient_checkpointing: true, or shard the model with dist.strategy: fsdp")


def min_over_ranks(value: int, device: torch.device) -> int:
    """The smallest `value` over the ranks of the process group (the value itself without one)."""
    import torch.distributed as torch_dist

    return int(dist.all_reduce(torch.tensor([value], device=device), torch_dist.ReduceOp.MIN).item())


def training_step(model: nn.Module, batch: Callable[[int], Any], device: torch.device,
                  autocast_ctx: Callable[[], contextlib.AbstractContextManager[None]],
                  loss_of: LossStep | None = None, accum_of: Callable[[int], int] = lambda size: 1
                  ) -> Callable[[int], None]:
    """One forward and backward of `model` on `batch(size)`, with room for AdamW's two moments held meanwhile: the
    memory of a training step. When `accum_of(size)` > 1 the step accumulates: every gradient is made (zeros)
    before the forward, as a first micro-batch would have left it, so the backward adds into whole gradients as the
    second micro-batch's does. No optimizer step, and the RNG is restored: the weights, the dropout draws and the
    data order stay those of a run given that micro-batch by hand.

    No collective runs in it, so a rank that runs out of memory leaves no peer waiting in one, and `step_down`'s
    all-reduce of the outcome is the next collective of every rank: under DDP the gradient all-reduce is off
    (`no_sync`); under FSDP/HSDP, whose forward and backward gather weights and scatter gradients as they go, each
    gather and scatter is a rank-local stand-in holding the same buffers (torch_compat.fsdp_collectives_local).
    Where this torch cannot do that, an out-of-memory under FSDP ends the run on that rank (exit 1, one line; the
    launcher stops its peers) instead of leaving them in a collective. `loss_of`: the training step's forward and
    loss (train/loss.py `loss_step`, compiled when the run compiles), so the step measured is the one the run
    takes; default the eager model's."""
    from kubetrain.torch_compat import fsdp_collectives_local

    loss_of = loss_of or loss_step(model, compiled=False)

    def attempt(size: int) -> None:
        trainable = [p for p in model.parameters() if p.requires_grad]
        moments = sum(2 * dist.local_part(p).numel() * p.element_size() for p in trainable)
        no_sync = getattr(model, "no_sync", None)
        rng = torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
        try:
            with rng, no_sync() if no_sync is not None else contextlib.nullcontext(), \
                    fsdp_collectives_local(model) as rank_local:
                try:
                    held = torch.empty(moments, dtype=torch.uint8, device=device)
                    if accum_of(size) > 1:  # the gradients of the micro-batches before this one
                        for p in trainable:
                            p.grad = torch.zeros_like(p)
                    b = batch(size).to(device)
                    with autocast_ctx():
                        loss = loss_of(b.input_ids, b.labels, b.position_ids) / counted_tokens(b.labels).clamp(min=1)
                    loss.backward()
                    del held, loss
                except (torch.OutOfMemoryError, RuntimeError) as e:
                    if rank_local or not is_out_of_memory(e):
                        raise
                    raise TrainingFailed(f"out of memory in the confirming step at micro-batch {size} under "
                                         f"{type(model).__name__}, whose collectives this torch cannot keep "
                                         f"rank-local; set train.micro_batch_size below {size}") from None
        finally:
            model.zero_grad(set_to_none=True)

    return attempt


def confirm(cfg: Config, choice: MicroBatchChoice, attempt: Callable[[int], None], device: torch.device,
            world_size: int) -> tuple[Config, str]:
    """`cfg` with the micro-batch that ran one training step on every rank, from the smallest choice of the ranks
    down, and the start-up line that says which and why."""
    t = cfg.train
    assert t.global_batch_size is not None  # `auto` needs it (the schema's validator)
    start = min_over_ranks(choice.micro_batch, device)
    sizes = [c for c in choice.candidates if c <= start]
    size, failed = step_down(attempt, sizes, lambda ok: min_over_ranks(ok, device))
    if failed:  # a compiled model recompiled for each size (and went dynamic): compile once more, for this one
        torch.compiler.reset()
    if device.type == "cuda":  # the peak the run reports (report_peak) is its own, not the out-of-memory tries'
        torch.cuda.reset_peak_memory_stats(device)
    per_process = per_process_batch(t.global_batch_size, world_size)
    accum = accum_steps(per_process, size, t.global_batch_size, world_size)
    why = choice.describe()
    if start != choice.micro_batch:
        why += f"; {start}, the smallest choice of the {world_size} processes"
    why += (f"; {', '.join(map(str, failed))} ran out of memory in the confirming step" if failed
            else "; confirmed by one training step")
    resolved = with_batch(cfg, size, accum)
    return resolved, batch_line(resolved, world_size, why)


def batch_line(cfg: Config, world_size: int, why: str) -> str:
    """`micro-batch 8 x 4 accum x 2 processes = global batch 64 (auto: why)`."""
    t = cfg.train
    procs = f"{world_size} process" + ("es" if world_size > 1 else "")
    return (f"micro-batch {t.micro_batch} x {t.grad_accum_steps} accum x {procs} = global batch "
            f"{t.global_batch_size} (auto: {why})")


def start_line(cfg: Config, choice: MicroBatchChoice, world_size: int) -> str:
    """The start-up line of a choice that no step confirmed (a dry run)."""
    return batch_line(cfg, world_size, f"{choice.describe()}; a run confirms it by one training step")


def confirm_on_model(cfg: Config, choice: MicroBatchChoice, model: nn.Module, windows: TokenWindows,
                     device: torch.device, autocast_ctx: Callable[[], contextlib.AbstractContextManager[None]],
                     world_size: int, dry_run: bool = False, loss_of: LossStep | None = None) -> tuple[Config, str]:
    """The Trainer's part: `confirm` the choice with a training step of `model` on the first windows of the
    training data (a dry run takes the estimate's choice as it is), and the start-up line."""
    if dry_run:
        return cfg, start_line(cfg, choice, world_size)
    batch = lambda size: TrainLoader(windows, size, cfg.run.seed).next_batch()  # noqa: E731
    assert cfg.train.global_batch_size is not None  # `auto` needs it (the schema's validator)
    per_process = per_process_batch(cfg.train.global_batch_size, world_size)
    attempt = training_step(model, batch, device, autocast_ctx, loss_of, lambda size: per_process // size)
    return confirm(cfg, choice, attempt, device, world_size)

"""The batch a run trains with: `train.global_batch_size` kept by grad accumulation, and `micro_batch_size: auto`.

`resolve_batch` is the one boundary where `auto` becomes a number and grad_accum_steps is derived from the global
batch: the worker (`train`), the launcher's memory check, `kubetrain doctor` and `k8s render` call it, and every
reader after it (the loader, the memory estimate, the loop) sees ints.

`auto` picks, among the micro-batches that divide this process's share of the global batch (so accumulation is
whole), the largest whose memory estimate (`memory.estimate_on`, for the run's layout) fits the device: a pure
choice (`choose`). The Trainer then confirms it with one forward and backward on the real model (`confirm`),
stepping down to the next smaller candidate on out-of-memory, as DeepSpeed's and Lightning's batch-size finders do;
the global batch stays, grad_accum_steps grows.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kubetrain.config.schema import Config
from kubetrain.data.loader import TokenWindows, TrainLoader
from kubetrain.errors import TrainingFailed, UserInputError
from kubetrain.memory import Layout, estimate_on
from kubetrain.models.loss import counted_tokens
from kubetrain.train.loss import LossStep, loss_step

GIB = 2**30
# Of the memory free at start, what `auto` plans to fill: the estimate is within about 10% of the measured peak
# (issue 34's target), and the allocator's fragmentation and the CUDA context want some room of their own.
HEADROOM = 0.9


@dataclass(frozen=True)
class MicroBatchChoice:
    """What `auto` chose, and why: the candidates it looked at, the estimate of the choice and the budget."""

    micro_batch: int
    candidates: tuple[int, ...]  # largest first
    need: int  # bytes the estimate gives the choice (what the device must hold: `Estimate.device_need`)
    budget: int  # bytes it had to fit in
    fits: bool  # False: not even the smallest candidate fits (the memory check then refuses the run)
    budget_from: str = ""  # where the budget comes from, in words

    def describe(self) -> str:
        """Why: `the largest of 32, 16, 8 whose memory estimate (3.1 GiB) fits the budget (4.0 GiB: ...)`."""
        sizes = ", ".join(str(c) for c in self.candidates)
        if self.fits:
            return (f"the largest of {sizes} whose memory estimate ({_size(self.need)}) fits the budget "
                    f"({_size(self.budget)}: {self.budget_from})")
        return (f"the smallest of {sizes}, though its memory estimate ({_size(self.need)}) exceeds the budget "
                f"({_size(self.budget)}: {self.budget_from})")

    def to_json(self) -> dict[str, Any]:
        return {"micro_batch_size": self.micro_batch, "candidates": list(self.candidates), "need": self.need,
                "budget": self.budget, "fits": self.fits, "budget_from": self.budget_from}


def _size(n: int) -> str:
    """Bytes in GiB, or MiB below a tenth of one (a tiny model is not "0.00 GiB")."""
    return f"{n / GIB:.1f} GiB" if n >= GIB / 10 else f"{n / 2**20:.1f} MiB"


# --- pure: the plan of a batch, the candidates, the choice ---------------------------------------------------


def per_process_batch(global_batch: int, world_size: int) -> int:
    """Sequences per optimizer step of one process; a global batch the processes cannot share evenly is bad input."""
    if global_batch % world_size:
        raise UserInputError(f"train.global_batch_size {global_batch} is not a multiple of the {world_size} "
                             f"processes; use a multiple of {world_size}")
    return global_batch // world_size


def accum_steps(per_process: int, micro_batch: int, global_batch: int, world_size: int) -> int:
    """grad_accum_steps that keeps the global batch with this micro-batch; one that does not divide it is bad input."""
    if per_process % micro_batch:
        raise UserInputError(f"train.micro_batch_size {micro_batch} does not divide the {per_process} sequences per "
                             f"process of train.global_batch_size {global_batch} over {world_size} processes")
    return per_process // micro_batch


def candidates(per_process: int) -> list[int]:
    """The micro-batches `auto` may choose, largest first: those that divide one process's share of the global
    batch, so that grad accumulation keeps it exactly (a power of two steps down by halving)."""
    return [b for b in range(per_process, 0, -1) if per_process % b == 0]


def choose(sizes: Sequence[int], need: Callable[[int], int], budget: int, budget_from: str = ""
           ) -> MicroBatchChoice:
    """The largest of `sizes` whose `need` (bytes) is at most `budget`; the smallest, marked as not fitting, when
    none is. `need` grows with the micro-batch, so a binary search asks it a few times (an estimate builds the model
    on the meta device each time)."""
    ordered = tuple(sorted(set(sizes), reverse=True))
    if not ordered:
        raise ValueError("no micro-batch sizes to choose from")
    asked: dict[int, int] = {}

    def need_of(size: int) -> int:
        if size not in asked:
            asked[size] = need(size)
        return asked[size]

    ascending = ordered[::-1]
    lo, hi, best = 0, len(ascending) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if need_of(ascending[mid]) <= budget:
            best, lo = ascending[mid], mid + 1
        else:
            hi = mid - 1
    if best is None:
        return MicroBatchChoice(ascending[0], ordered, need_of(ascending[0]), budget, False, budget_from)
    return MicroBatchChoice(best, ordered, need_of(best), budget, True, budget_from)


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
    """`choose` with the memory estimate of `cfg` at each size, on `device` for `layout`, against the budget."""
    budget, budget_from = budget_for(cfg, device, budget)

    def need(size: int) -> int:
        est = estimate_on(with_batch(cfg, size, 1), layout, device)
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
    return int(free * HEADROOM), f"{HEADROOM:.0%} of the {_size(free)} free on {device.type}"


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
    from kubetrain.train.device import is_out_of_memory

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

    if not (torch_dist.is_available() and torch_dist.is_initialized()):
        return value
    t = torch.tensor([value], device=device)
    torch_dist.all_reduce(t, op=torch_dist.ReduceOp.MIN)
    return int(t.item())


def training_step(model: nn.Module, batch: Callable[[int], Any], device: torch.device,
                  autocast_ctx: Callable[[], contextlib.AbstractContextManager[None]],
                  loss_of: LossStep | None = None) -> Callable[[int], None]:
    """One forward and backward of `model` on `batch(size)`, with room for AdamW's two moments held meanwhile: the
    memory of a training step. No optimizer step, and the RNG is restored: the weights, the dropout draws and the
    data order stay those of a run given that micro-batch by hand. Under DDP without the gradient all-reduce
    (`no_sync`): a rank that runs out of memory leaves no peer waiting in a collective. `loss_of`: the training
    step's forward and loss (train/loss.py `loss_step`, compiled when the run compiles), so the step measured is
    the one the run takes; default the eager model's."""
    loss_of = loss_of or loss_step(model, compiled=False)

    def attempt(size: int) -> None:
        moments = sum(2 * _local(p).numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        no_sync = getattr(model, "no_sync", None)
        rng = torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
        try:
            with rng, no_sync() if no_sync is not None else contextlib.nullcontext():
                held = torch.empty(moments, dtype=torch.uint8, device=device)
                b = batch(size).to(device)
                with autocast_ctx():
                    loss = loss_of(b.input_ids, b.labels) / counted_tokens(b.labels)
                loss.backward()
                del held, loss
        finally:
            model.zero_grad(set_to_none=True)

    return attempt


def _local(p: torch.Tensor) -> torch.Tensor:
    """A parameter's own part: its shard under FSDP2 (a DTensor), else itself."""
    to_local = getattr(p, "to_local", None)
    return to_local() if callable(to_local) else p


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


def resolve_here(cfg: Config, budget: int | None = None) -> tuple[Config, MicroBatchChoice | None]:
    """`resolve_batch` for this process: the layout torchrun gave it (one process without it), its device."""
    from kubetrain.distributed.env import process_env
    from kubetrain.train.device import select_device

    penv = process_env()
    layout = Layout.of(cfg, penv.world_size, penv.local_world_size)
    return resolve_batch(cfg, layout, select_device(cfg.run.device), budget)


def confirm_on_model(cfg: Config, choice: MicroBatchChoice, model: nn.Module, windows: TokenWindows,
                     device: torch.device, autocast_ctx: Callable[[], contextlib.AbstractContextManager[None]],
                     world_size: int, dry_run: bool = False, loss_of: LossStep | None = None) -> tuple[Config, str]:
    """The Trainer's part: `confirm` the choice with a training step of `model` on the first windows of the
    training data (a dry run takes the estimate's choice as it is), and the start-up line."""
    if dry_run:
        return cfg, start_line(cfg, choice, world_size)
    batch = lambda size: TrainLoader(windows, size, cfg.run.seed).next_batch()  # noqa: E731
    return confirm(cfg, choice, training_step(model, batch, device, autocast_ctx, loss_of), device, world_size)

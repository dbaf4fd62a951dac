"""train.accumulation: a window with no counted token (every label masked: chat rows of prompt only) is a step that
changes nothing (no AdamW step: no momentum, no weight decay, no step count), counted and logged as empty; the step
counter still moves, so the data and the LR schedule stay where they would be. Under DDP the window's count is every
rank's: a rank whose own micro-batches count nothing still steps with the others."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kubetrain.config.loading import validate
from kubetrain.config.schema import Config
from kubetrain.data.loader import IGNORE_INDEX, Batch
from kubetrain.train.optim import lr_at
from kubetrain.train.state import optimizer_steps
from kubetrain.train.trainer import RunOptions, Trainer


def config(root: Path) -> Config:
    return validate({
        "run": {"name": "empty", "output_dir": str(root), "threads": 1},
        "model": {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16},
        # weight decay on: an AdamW step over zero gradients would still shrink every matrix
        "train": {"max_steps": 6, "micro_batch_size": 2, "grad_accum_steps": 2, "warmup_steps": 0,
                  "log_every_steps": 1, "weight_decay": 0.1},
        "eval": {"every_steps": 100, "windows": 2, "sample_prompt": None},
        "checkpoint": {"every_steps": 100, "async_save": False},
        "track": {"console": False},
    })


def opened(root: Path) -> Trainer:
    trainer = Trainer(config(root), RunOptions(argv=[]), log=lambda m: None)
    trainer.setup()
    trainer.open()
    return trainer


def prompt_only(trainer: Trainer, steps: dict[int, Callable[[int], bool]]) -> None:
    """Every micro-batch of step k (1-based) counts no token on the ranks `steps[k]` says yes to."""
    fetch = trainer.loader.next_batch

    def next_batch() -> Batch:  # the step's window is fetched before the step counts
        batch, step = fetch(), trainer.state.step + 1
        if step in steps and steps[step](trainer.penv.rank):
            batch.labels[:] = IGNORE_INDEX
        return batch

    trainer.loader.next_batch = next_batch  # type: ignore[method-assign]


def state_of(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Weights and optimizer state (moments and step counts), copied."""
    out = {f"w.{k}": v.detach().clone() for k, v in trainer.base.state_dict().items()}
    for i, state in trainer.optimizer.state_dict()["state"].items():
        out.update({f"o.{i}.{k}": v.clone() for k, v in state.items()})
    return out


def changed(trainer: Trainer, before: dict[str, torch.Tensor]) -> list[str]:
    after = state_of(trainer)
    assert after.keys() == before.keys()
    return [k for k, v in before.items() if not torch.equal(after[k], v)]


def test_a_window_that_counts_no_token_changes_no_weight_and_no_optimizer_state(tmp_path: Path) -> None:
    trainer = opened(tmp_path)
    prompt_only(trainer, {2: lambda rank: True})
    trainer.train_step()
    before = state_of(trainer)
    trainer.train_step()  # every label masked
    assert changed(trainer, before) == []  # bitwise: weights, both moments, the step count
    assert optimizer_steps(trainer.optimizer) == 1
    assert trainer.state.step == 2  # the step counts: the next window and the next LR are step 3's
    trainer.train_step()
    assert trainer.optimizer.param_groups[0]["lr"] == lr_at(2, trainer.cfg.train, trainer.max_steps)
    assert optimizer_steps(trainer.optimizer) == 2 and changed(trainer, before) != []
    trainer.log_train()
    assert int(trainer.guard.streak) == 0
    records = [json.loads(line) for line in (tmp_path / "empty" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["empty_steps"], r["skipped_steps"]) for r in records if r["kind"] == "train"] == [(3, 1, 0)]
    assert trainer.state.empty_steps == 1 and trainer.state.skipped_steps == 0


def _ranks(rank: int, world: int, root: Path) -> None:
    """One of two DDP ranks: step 2 counts no token on rank 1 alone, step 3 on neither."""
    import torch.distributed as td

    from kubetrain.distributed.setup import teardown

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    td.init_process_group("gloo", init_method=f"file://{root}/store", rank=rank, world_size=world)
    trainer = opened(root)
    prompt_only(trainer, {2: lambda r: r == 1, 3: lambda r: True})
    trainer.train_step()
    before = state_of(trainer)
    trainer.train_step()
    seen: dict[str, Any] = {"one_rank_empty_steps": optimizer_steps(trainer.optimizer) == 2
                            and any(k.startswith("w.") for k in changed(trainer, before))}
    before = state_of(trainer)
    trainer.train_step()
    seen["all_empty_changed"] = changed(trainer, before)
    trainer.log_train()
    seen["counts"] = (getattr(trainer.state, "empty_steps", None), trainer.state.skipped_steps)
    torch.save(seen, root / f"rank{rank}.pt")
    teardown()


@pytest.mark.slow
def test_under_ddp_an_empty_micro_batch_on_one_rank_steps_and_an_empty_window_everywhere_does_not(
    tmp_path: Path,
) -> None:
    import torch.multiprocessing as mp

    mp.start_processes(_ranks, args=(2, tmp_path), nprocs=2, start_method="spawn")
    for rank in range(2):
        seen = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert seen["one_rank_empty_steps"], rank  # the window counted tokens on rank 0: a step on every rank
        assert seen["all_empty_changed"] == [], rank
        assert seen["counts"] == (1, 0), rank

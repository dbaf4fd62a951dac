"""One loss for any split of the batch (train/accumulation.py): on masked chat data, whose windows count very
different numbers of tokens, micro-batch x accumulation, the number of processes, DDP and FSDP give the same loss,
the same gradients and the same weights after 3 steps, through the Trainer's own train_step.

Each micro-batch normalised by its own counted tokens (and each rank by its own) weighs a window of 3 counted tokens
like one of 60: then every split below trains something else (measured on that code: step 1's gradients 50% apart,
the weights' updates after 3 steps 70-80% apart).

Tolerances: the loss of every step and the gradients of step 1 (the same weights everywhere) within 1e-6 relative:
fp32 on the CPU, where only the order of the sums differs. After step 1, AdamW divides each gradient by its root
mean square + eps (1e-8): an element whose gradient is near eps moves by up to lr x its relative rounding error, so
the later gradients and the weights' updates are compared within 1e-4 (measured: 2e-5 at 1 x 16)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from kubetrain.config.loading import validate
from kubetrain.config.schema import Config
from kubetrain.data.loader import IGNORE_INDEX, TrainLoader
from kubetrain.models.loss import lm_loss
from kubetrain.train.trainer import RunOptions, Trainer

GLOBAL = 16  # sequences per optimizer step, over all processes
SPLITS = [(16, 1), (8, 2), (4, 4), (1, 16)]  # micro-batch x accumulation on one process
STEPS = 3
RELATIVE = 1e-6  # the loss, and the gradients of the first step
AFTER_ADAM = 1e-4  # the gradients of later steps, and the weights' updates


Reference = tuple[Path, Path, dict[str, torch.Tensor], dict[str, Any]]  # data, init checkpoint, init weights, 16x1


def _write_chat(path: Path) -> Path:
    """Conversations in runs: some mostly prompt (a window of them counts a few tokens), some mostly answer."""
    rng = random.Random(0)
    rows = []
    for i in range(160):
        words = "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(50, 90)))
        if (i // 6) % 2:
            messages = [{"role": "user", "content": words}, {"role": "assistant", "content": "ok"}]
        else:
            messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": words}]
        rows.append(json.dumps({"messages": messages}))
    path.write_text("\n".join(rows) + "\n")
    return path


def _config(root: Path, name: str, micro: int, accum: int, strategy: str = "ddp") -> Config:
    return validate({
        "run": {"name": name, "output_dir": str(root / "runs"), "threads": 1, "seed": 5},
        "data": {"sources": [{"kind": "chat", "path": str(root / "chat.jsonl")}],
                 "chat": {"template": "chatml", "packing": True},
                 "cache_dir": str(root / "cache"), "val_fraction": 0.1},
        "model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 128},
        "train": {"max_steps": STEPS, "micro_batch_size": micro, "grad_accum_steps": accum, "warmup_steps": 0,
                  "lr": 1e-2, "grad_clip": 0.0, "log_every_steps": 1},
        "eval": {"every_steps": 100, "windows": 1, "sample_prompt": None},
        "checkpoint": {"every_steps": 100, "async_save": False},
        "dist": {"strategy": strategy},
        "track": {"console": False},
    })


def _full(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)  # FSDP: the whole tensor from every rank's shard (a collective)
    return (full() if full is not None else t).detach().clone()


def _train(root: Path, name: str, micro: int, accum: int, init: Path, strategy: str = "ddp") -> dict[str, Any]:
    """STEPS steps of the Trainer from the weights of `init`: each step's logged loss and gradients, the weights."""
    trainer = Trainer(_config(root, name, micro, accum, strategy), RunOptions(argv=[], resume="never",
                                                                            init_weights=init), log=lambda m: None)
    trainer.setup()
    trainer.open()
    named = list(trainer.base.named_parameters())
    grads: list[dict[str, torch.Tensor]] = []
    hook = trainer.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: grads.append({n: _full(p.grad) for n, p in named if p.grad is not None}))
    losses = []
    for _ in range(STEPS):
        trainer.train_step()
        trainer.log_train()
        losses.append(trainer.state.last_train_loss)
    hook.remove()
    return {"losses": losses, "grads": grads, "weights": {n: _full(p) for n, p in named}, "trainer": trainer}


def _assert_close(found: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], relative: float, what: str,
                  base: dict[str, torch.Tensor] | None = None) -> None:
    """Each tensor within `relative` of the expected one (by norm); with `base`: their changes from it."""
    assert found.keys() == expected.keys(), what
    for name, want in expected.items():
        scale = float((want - base[name]).norm() if base else want.norm())
        error = float((found[name] - want).norm())
        assert error <= relative * scale, f"{what}: {name} differs by {error} of {scale}"


def _assert_same_training(found: dict[str, Any], expected: dict[str, Any], init: dict[str, torch.Tensor],
                          what: str) -> None:
    assert found["losses"] == pytest.approx(expected["losses"], rel=RELATIVE), what
    assert len(found["grads"]) == len(expected["grads"]) == STEPS, what
    for step, (g, want) in enumerate(zip(found["grads"], expected["grads"], strict=True)):
        _assert_close(g, want, RELATIVE if step == 0 else AFTER_ADAM, f"{what}: gradients of step {step + 1}")
    _assert_close(found["weights"], expected["weights"], AFTER_ADAM, f"{what}: updates after {STEPS} steps", init)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """The data, the initial weights every layout starts from (FSDP draws its own init), and 16 x 1 on one process."""
    root = tmp_path_factory.mktemp("split")
    _write_chat(root / "chat.jsonl")
    first = Trainer(_config(root, "init", GLOBAL, 1), RunOptions(argv=[]), log=lambda m: None)
    first.setup()
    first.open()
    saved = first.save()
    assert saved is not None
    init = saved.path
    weights = {n: p.detach().clone() for n, p in first.base.named_parameters()}

    # the data does what this test needs: windows of the first global batch count very different tokens
    batch = TrainLoader(first.train_windows, GLOBAL, first.cfg.run.seed).next_batch()
    counted = (batch.labels != IGNORE_INDEX).sum(dim=1)
    assert int(counted.min()) <= 6 and int(counted.max()) >= 24, counted.tolist()
    with torch.no_grad():  # the step's loss: every counted token of the global batch weighs the same
        whole_batch_loss = float(lm_loss(first.base(batch.input_ids), batch.labels))

    result = _train(root, "16x1", GLOBAL, 1, init)
    assert result["losses"][0] == pytest.approx(whole_batch_loss, rel=RELATIVE)
    return root, init, weights, result


@pytest.mark.parametrize("micro, accum", SPLITS[1:])
def test_micro_batch_and_accumulation_train_the_same_weights(
    reference: Reference, micro: int, accum: int
) -> None:
    root, init, weights, expected = reference
    found = _train(root, f"{micro}x{accum}", micro, accum, init)
    _assert_same_training(found, expected, weights, f"{micro} x {accum}")


# --- several processes (gloo), DDP and FSDP ---------------------------------------------------------------


def _ranks(rank: int, world: int, root: Path, init: Path, micro: int, accum: int) -> None:
    """One of `world` ranks: DDP, then FSDP, from the same weights; then one window that gives inf on rank 1 alone."""
    import torch.distributed as td

    from kubetrain.distributed.setup import teardown

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    td.init_process_group("gloo", init_method=f"file://{root}/store-{world}", rank=rank, world_size=world)
    found: dict[str, Any] = {}
    for strategy in ("ddp", "fsdp"):
        run = _train(root, f"{strategy}-{world}", micro, accum, init, strategy)
        trainer = run.pop("trainer")
        # a window whose loss is inf on one rank only: no rank changes a weight or the optimizer's state
        state = {n: _full(t) for n, t in trainer.optimizer.state_dict()["state"][0].items()}
        hook = trainer.base.embed.register_forward_hook(lambda m, a, out: out * float("inf") if rank == 1 else out)
        trainer.train_step()
        hook.remove()
        after = {n: _full(p) for n, p in trainer.base.named_parameters()}
        run["skipped_unchanged"] = (
            all(torch.equal(after[n], w) for n, w in run["weights"].items())
            and all(torch.equal(_full(t), state[n]) for n, t in trainer.optimizer.state_dict()["state"][0].items())
            and int(trainer.guard.streak) == 1)
        found[strategy] = run
    if rank == 0:
        torch.save(found, root / f"world-{world}.pt")
    teardown()


@pytest.mark.slow
@pytest.mark.parametrize("world, micro, accum", [(2, 4, 2), pytest.param(4, 1, 4, marks=pytest.mark.ci)])  # 4: in CI
def test_processes_ddp_and_fsdp_train_the_same_weights(
    reference: Reference, world: int, micro: int, accum: int
) -> None:
    import torch.multiprocessing as mp

    root, init, weights, expected = reference
    mp.start_processes(_ranks, args=(world, root, init, micro, accum), nprocs=world, start_method="spawn")
    found = torch.load(root / f"world-{world}.pt", weights_only=True)
    for strategy in ("ddp", "fsdp"):
        _assert_same_training(found[strategy], expected, weights,
                              f"{strategy} x {world} processes ({micro} x {accum})")
        assert found[strategy]["skipped_unchanged"], strategy

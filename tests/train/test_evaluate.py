"""The loss the loop trains on, and evaluation: the same forwards on every rank, the same loss at any world size."""

from __future__ import annotations

import contextlib
import datetime
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as td
import torch.multiprocessing as mp

from kubetrain.config.loading import validate
from kubetrain.config.schema import ModelConfig
from kubetrain.data.loader import TokenWindows
from kubetrain.data.shards import Prepared
from kubetrain.distributed.env import ProcessEnv
from kubetrain.distributed.parallelize import parallelize
from kubetrain.distributed.setup import teardown
from kubetrain.models import build_model
from kubetrain.models.loss import lm_loss
from kubetrain.train.evaluate import eval_batches, evaluate, perplexity

BLOCK, VOCAB = 8, 64
# (validation windows, micro-batch, eval.windows: windows evaluated): uneven splits, a short last batch, more ranks
# than windows, fewer windows asked than there are
CASES = [(7, 2, 16), (7, 3, 6), (2, 2, 16), (1, 4, 4), (7, 4, 5)]


def test_perplexity_of_a_huge_loss_is_finite() -> None:
    assert 0 < perplexity(1000.0) < float("inf")


@pytest.mark.parametrize("n_windows, batch, n_eval", CASES)
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_every_rank_runs_the_same_forwards_and_all_windows_are_counted_once(
    n_windows: int, batch: int, n_eval: int, world: int
) -> None:
    plans = [eval_batches(n_windows, batch, n_eval, rank, world) for rank in range(world)]
    assert len({tuple(len(b) for b in plan) for plan in plans}) == 1  # same number and sizes of forwards
    assert all(plan for plan in plans)  # even a rank without a window runs them
    assert all(len(b) <= batch for plan in plans for b in plan)  # a forward holds a micro-batch at most
    real = sorted(i for plan in plans for b in plan for i in b if i is not None)
    assert real == list(range(min(n_windows, n_eval)))  # eval.windows counts windows, whatever the micro-batch


PART = "parts/00000"  # one part of the shard index holds the windows


def _write_windows(root: Path) -> None:
    """For each case, n validation windows of random tokens, with a loss mask so windows count unequal tokens."""
    for n_windows, _, _ in CASES:
        folder = root / str(n_windows)
        (folder / "parts").mkdir(parents=True, exist_ok=True)
        n = n_windows * BLOCK + 1
        rng = np.random.default_rng(n_windows)
        rng.integers(0, VOCAB, n, dtype=np.uint16).tofile(folder / f"{PART}.bin")
        (rng.random(n) < 0.6).astype(np.uint8).tofile(folder / f"{PART}.mask")


def _windows(folder: Path, n_windows: int) -> TokenWindows:
    n = n_windows * BLOCK + 1
    meta = {"dtype": "uint16", "tokens": n, "train_tokens": 0, "val_tokens": n, "masked": True,
            "parts": [{"part": PART, "tokens": n}]}
    return TokenWindows(Prepared(folder, meta), "val", BLOCK)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(ModelConfig(n_layer=2, n_head=2, n_embd=16, block_size=BLOCK), VOCAB)


def _losses(root: Path, rank: int, world: int, strategy: str) -> list[float]:
    model = _model()
    if world > 1:
        cfg = validate({"dist": {"strategy": strategy}})
        model = parallelize(model, cfg, ProcessEnv(rank, world), torch.device("cpu"), "fp32")
    cpu = torch.device("cpu")
    return [evaluate(model, _windows(root / str(n), n), batch, n_eval, cpu, contextlib.nullcontext, rank, world)
            for n, batch, n_eval in CASES]


def test_one_process_loss_is_the_token_weighted_mean_over_the_windows(tmp_path: Path) -> None:
    _write_windows(tmp_path)
    model = _model().eval()
    expected = []
    for n, _, n_eval in CASES:
        windows = _windows(tmp_path / str(n), n)
        every = windows.batch(list(range(min(n, n_eval))))
        with torch.no_grad():
            expected.append(float(lm_loss(model(every.input_ids), every.labels)))
    assert _losses(tmp_path, 0, 1, "ddp") == pytest.approx(expected, rel=1e-6)


def test_the_val_loss_does_not_move_with_the_micro_batch(tmp_path: Path) -> None:
    """eval.windows counts windows: micro_batch_size (auto's choice, a resume's) changes the forwards, not the loss,
    so `best` compares across them. Masked windows count unequal tokens: a mean of per-batch means would move."""
    _write_windows(tmp_path)
    model, cpu = _model(), torch.device("cpu")
    windows = _windows(tmp_path / "7", 7)
    losses = [evaluate(model, windows, batch, 5, cpu, contextlib.nullcontext) for batch in (1, 2, 3, 5, 8)]
    assert losses == pytest.approx([losses[0]] * len(losses), rel=1e-6)


def _worker(rank: int, world: int, root: Path) -> None:
    torch.set_num_threads(1)
    td.init_process_group("gloo", init_method=f"file://{root}/rendezvous", rank=rank, world_size=world,
                          timeout=datetime.timedelta(seconds=60))  # a hang fails the test instead of holding it
    found = {strategy: _losses(root, rank, world, strategy) for strategy in ("ddp", "fsdp")}
    (root / f"losses-{rank}.json").write_text(json.dumps(found))
    teardown()  # the way every run ends: a barrier, then the group and its backend go (distributed/setup.py)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_distributed_loss_equals_one_process_loss_under_ddp_and_fsdp(world: int, tmp_path: Path) -> None:
    _write_windows(tmp_path)
    alone = _losses(tmp_path, 0, 1, "ddp")
    mp.start_processes(_worker, args=(world, tmp_path), nprocs=world, start_method="spawn")
    for rank in range(world):
        found = json.loads((tmp_path / f"losses-{rank}.json").read_text())
        for strategy in ("ddp", "fsdp"):
            assert found[strategy] == pytest.approx(alone, rel=1e-6), (strategy, rank)


def test_the_val_loss_of_a_chat_set_is_the_same_packed_and_unpacked(tmp_path: Path) -> None:
    """Every validation conversation counted once either way, each attending only to itself from position 0."""
    from kubetrain.data.shards import prepare
    from kubetrain.models import gpt_config
    from kubetrain.models.gpt import GPT
    from tests.hf_models import skewed_chat_rows

    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps(r) + "\n" for r in skewed_chat_rows(160, 40)))
    losses = {}
    for packing in (False, True):
        cfg = validate({"run": {"output_dir": str(tmp_path)},
                        "data": {"sources": [{"kind": "chat", "path": str(chat)}], "val_fraction": 0.25,
                                 "chat": {"template": "chatml", "packing": packing}},
                        "model": {"block_size": 256, "n_layer": 1, "n_head": 2, "n_embd": 32}})
        prepared = prepare(cfg)
        torch.manual_seed(0)
        model = GPT(gpt_config(cfg.model, prepared.tokenizer().vocab_size))
        windows = TokenWindows(prepared, "val", 256)
        losses[packing] = evaluate(model, windows, 4, windows.n_windows, torch.device("cpu"), contextlib.nullcontext)
    assert losses[True] == pytest.approx(losses[False], rel=1e-6)

"""`train.micro_batch_size: auto` and `train.global_batch_size`: the estimate of each candidate and the budget, the
boundary that resolves a config to ints, the confirming step stepping down on a real out-of-memory, and runs of
the real trainer, whose losses equal those of the same micro-batch given by hand."""

from __future__ import annotations

import json
import os
import resource
from pathlib import Path

import pytest
import torch

from kubetrain.config import load_config
from kubetrain.errors import ConfigError, TrainingFailed, UserInputError
from kubetrain.memory import Layout, estimate_on
from kubetrain.train.device import autocast
from kubetrain.train.micro_batch import (
    budget_for,
    confirm_on_model,
    planning_config,
    resolve_batch,
    step_down,
    training_step,
    with_batch,
)
from kubetrain.train.micro_batch_choice import HEADROOM, candidates
from kubetrain.train.trainer import RunOptions, Trainer, train
from tests.train.conftest import TINY, kubetrain, sets

CPU = torch.device("cpu")
AUTO = [*TINY, "train.micro_batch_size=auto", "train.global_batch_size=64"]
MIB = 2**20


def need_at(cfg_overrides: list[str], size: int, layout: Layout | None = None) -> int:
    """The estimate of `size` as auto trains it: with the accumulation that keeps the global batch."""
    cfg = load_config(None, None, cfg_overrides)
    lay = layout or Layout.of(cfg)
    assert cfg.train.global_batch_size is not None
    est = estimate_on(with_batch(cfg, size, cfg.train.global_batch_size // lay.world_size // size), lay, CPU)
    assert not isinstance(est, str)
    return est.device_need


# --- the boundary: auto -> ints, by the real estimate and a budget given ---------------------------------------


def test_auto_is_the_largest_candidate_whose_estimate_fits_the_budget() -> None:
    cfg = load_config(None, None, AUTO)
    budget = need_at(AUTO, 16) + MIB // 10  # 16 fits, 32 does not
    assert need_at(AUTO, 32) > budget
    resolved, choice = resolve_batch(cfg, Layout.of(cfg), CPU, budget)
    assert choice is not None and choice.fits and choice.candidates == (64, 32, 16, 8, 4, 2, 1)
    assert (resolved.train.micro_batch_size, resolved.train.grad_accum_steps) == (16, 4)  # 16 x 4 = 64
    assert choice.need == need_at(AUTO, 16) and choice.budget == budget
    # everything else is the config as it was; the original still says auto
    assert resolved.model == cfg.model and cfg.train.micro_batch_size == "auto"
    # a budget every candidate fits: the whole batch in one micro-batch
    big, _ = resolve_batch(cfg, Layout.of(cfg), CPU, need_at(AUTO, 64))
    assert (big.train.micro_batch, big.train.grad_accum_steps) == (64, 1)


def test_on_the_cpu_the_node_processes_share_the_budget() -> None:
    cfg = load_config(None, None, AUTO)
    four = Layout.of(cfg, 4, 4)  # 64 over 4 processes: 16 each, and the four share the RAM
    budget = need_at(AUTO, 8, four) + MIB // 10
    resolved, choice = resolve_batch(cfg, four, CPU, budget)
    assert choice is not None and choice.candidates == (16, 8, 4, 2, 1)
    assert (resolved.train.micro_batch, resolved.train.grad_accum_steps) == (8, 2)  # 8 x 2 accum x 4 = 64
    alone, _ = resolve_batch(cfg, Layout.of(cfg), CPU, budget)
    assert alone.train.micro_batch > 8  # one process has the same RAM to itself


def test_auto_s_choice_fits_its_budget_with_the_accumulation_it_trains_with() -> None:
    # Each candidate but the whole share accumulates: its whole gradients exist beside the next micro-batch's
    # activations. Whatever the budget, the choice that fits must fit as the run (and the memory check) counts it.
    cfg = load_config(None, None, AUTO)
    layout = Layout.of(cfg)
    for size in candidates(64):
        budget = need_at(AUTO, size)  # exactly what `size` needs as trained: it fits, nothing larger does
        resolved, choice = resolve_batch(cfg, layout, CPU, budget)
        assert choice is not None and choice.fits and choice.micro_batch == size
        est = estimate_on(resolved, layout, CPU)
        assert not isinstance(est, str) and est.device_need <= budget
        if size > 1:  # one byte less and `size` no longer fits, its accumulation's gradients included
            assert resolve_batch(cfg, layout, CPU, budget - 1)[0].train.micro_batch < size


def test_the_confirming_step_holds_whole_gradients_when_it_accumulates() -> None:
    from kubetrain.data.loader import Batch
    from kubetrain.models import build_model
    from kubetrain.train.loss import loss_step

    cfg = load_config(None, None, AUTO)
    model = build_model(cfg.model, 256)
    seen: list[bool] = []
    plain = loss_step(model, compiled=False)

    def loss_of(input_ids: torch.Tensor, labels: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        # at the forward of the confirming micro-batch: are the gradients of the ones before it in place?
        seen.append(all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters()))
        return plain(input_ids, labels, position_ids)

    def batch(size: int) -> Batch:
        ids = torch.randint(0, 256, (size, cfg.model.block_size))
        return Batch(ids, ids.clone())

    accumulating = training_step(model, batch, CPU, autocast("fp32", CPU), loss_of, accum_of=lambda size: 4)
    accumulating(2)
    alone = training_step(model, batch, CPU, autocast("fp32", CPU), loss_of, accum_of=lambda size: 1)
    alone(8)
    assert seen == [True, False]
    assert all(p.grad is None for p in model.parameters())  # nothing left behind for the run's first step


def test_the_budget_is_the_config_s_or_a_share_of_the_free_memory() -> None:
    cfg = load_config(None, None, [*AUTO, "train.memory_budget_gib=0.5"])
    assert budget_for(cfg, CPU) == (2**29, "train.memory_budget_gib")
    budget, where = budget_for(load_config(None, None, AUTO), CPU)
    assert f"{HEADROOM:.0%} of the " in where and where.endswith("free on cpu") and budget > 0


def test_a_global_batch_derives_the_accumulation_and_must_divide() -> None:
    cfg = load_config(None, None, [*TINY, "train.global_batch_size=64", "train.grad_accum_steps=3"])
    resolved, choice = resolve_batch(cfg, Layout.of(cfg, 2, 2), CPU)
    assert choice is None and (resolved.train.micro_batch, resolved.train.grad_accum_steps) == (4, 8)  # 4 x 8 x 2
    with pytest.raises(UserInputError, match="global_batch_size 64 is not a multiple of the 3 processes"):
        resolve_batch(cfg, Layout.of(cfg, 3, 3), CPU)
    odd = load_config(None, None, [*TINY, "train.global_batch_size=6"])
    with pytest.raises(UserInputError, match="micro_batch_size 4 does not divide the 6 sequences per process"):
        resolve_batch(odd, Layout.of(odd), CPU)
    plain = load_config(None, None, TINY)  # no global batch: the config as it is
    assert resolve_batch(plain, Layout.of(plain), CPU) == (plain, None)


def test_auto_needs_a_global_batch_and_k8s_plans_with_the_smallest_candidate() -> None:
    with pytest.raises(ConfigError, match=r"micro_batch_size auto needs train\.global_batch_size"):
        load_config(None, None, [*TINY, "train.micro_batch_size=auto"])
    with pytest.raises(ConfigError, match="micro_batch_size"):
        load_config(None, None, [*TINY, "train.micro_batch_size=0"])
    cfg = load_config(None, None, AUTO)
    planned = planning_config(cfg, Layout.of(cfg, 2, 2))
    assert (planned.train.micro_batch, planned.train.grad_accum_steps) == (1, 32)
    with pytest.raises(RuntimeError, match="read before it was resolved"):
        _ = cfg.train.micro_batch


def test_k8s_render_takes_an_auto_config_and_keeps_auto_for_the_pods() -> None:
    from kubetrain.k8s.render.manifest import render

    cfg = load_config(None, None, [*AUTO, "k8s.nnodes=2", "k8s.resources.memory=8Gi"])  # the pod memory check runs
    config_map = next(o for o in render(cfg) if o["kind"] == "ConfigMap")
    text = next(iter(config_map["data"].values()))
    assert "micro_batch_size: auto" in text and "global_batch_size: 64" in text


def test_when_not_even_one_sequence_fits_the_memory_check_refuses_as_it_would_a_number() -> None:
    from kubetrain.train.memory_check import check_memory

    huge = load_config(None, None, ["model.n_layer=8", "model.n_embd=16384", "model.n_head=128",
                                    "train.micro_batch_size=auto", "train.global_batch_size=2"])
    with pytest.raises(UserInputError, match=r"^this run needs about .* use a smaller model"):
        check_memory(huge)  # resolved to the smallest candidate (1), which does not fit either


# --- the confirming step --------------------------------------------------------------------------------------


def test_step_down_passes_other_errors_and_fails_when_nothing_runs() -> None:
    def attempt(size: int) -> None:
        torch.empty(size << 50, dtype=torch.uint8)  # the CPU allocator's real refusal (PiBs)

    with pytest.raises(TrainingFailed, match="even at micro-batch 1"):
        step_down(attempt, [4, 2, 1])

    def broken(size: int) -> None:
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        step_down(broken, [2, 1])
    peers = iter([0, 1])  # another rank ran out of memory at 2, none at 1
    assert step_down(lambda size: None, [2, 1], agree=lambda ok: min(ok, next(peers))) == (1, [2])


def _vm_size() -> int:
    status = Path("/proc/self/status").read_text()
    return next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmSize"))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmSize from /proc")
def test_a_real_out_of_memory_in_the_confirming_step_steps_down(workdir: Path) -> None:
    # The address space is limited to what this process has mapped plus 100 MiB for the step: 256 sequences of 128
    # tokens need several times that (the allocator refuses), 8 need far less (the estimate: about 13 MiB).
    overrides = [*TINY, "model.n_embd=64", "model.block_size=128", "train.micro_batch_size=auto",
                 "train.global_batch_size=256", "eval.sample_prompt=null"]
    cfg = load_config(None, None, overrides)
    resolved, choice = resolve_batch(cfg, Layout.of(cfg), CPU, 2**40)  # a budget the estimate says all fit
    assert choice is not None and choice.micro_batch == 256
    trainer = Trainer(resolved, RunOptions())
    trainer.setup()
    weights = [p.detach().clone() for p in trainer.model.parameters()]
    rng = torch.get_rng_state()
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (_vm_size() + 100 * 2**20, hard))
    try:
        confirmed, line = confirm_on_model(resolved, choice, trainer.model, trainer.train_windows, CPU,
                                           autocast("fp32", CPU), 1)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    micro = confirmed.train.micro_batch
    assert 1 <= micro < 256 and micro * confirmed.train.grad_accum_steps == 256
    assert line.startswith(f"micro-batch {micro} x {256 // micro} accum x 1 process = global batch 256 (auto: ")
    assert "256, 128" in line and "ran out of memory in the confirming step" in line
    # the step changed nothing a run depends on: weights, gradients, the RNG
    assert all(torch.equal(a, b) for a, b in zip(weights, trainer.model.parameters(), strict=True))
    assert all(p.grad is None for p in trainer.model.parameters())
    assert torch.equal(rng, torch.get_rng_state())


# --- the real trainer -----------------------------------------------------------------------------------------


def _losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["kind"] == "train"]


@pytest.mark.slow
def test_a_run_with_auto_trains_as_the_same_batch_given_by_hand(tmp_path: Path) -> None:
    budget_gib = (need_at(AUTO, 16) + MIB // 10) / 2**30  # 16 fits, 32 does not (test above)
    common = ["train.max_steps=3", "model.dropout=0.1", "eval.every_steps=3"]
    auto = kubetrain("train", *sets(*AUTO[len(TINY):], *common, "run.name=auto",
                                    f"train.memory_budget_gib={budget_gib}"), cwd=tmp_path)
    line = next(x for x in auto.stdout.splitlines() if x.startswith("micro-batch "))
    assert line.startswith("micro-batch 16 x 4 accum x 1 process = global batch 64 (auto: the largest of 64, 32, "
                           "16, 8, 4, 2, 1 whose memory estimate")
    assert "train.memory_budget_gib); confirmed by one training step)" in line
    assert "tokens per step: 2,048 (16 seq x 32 tok x 4 accum x 1 ranks)" in auto.stdout
    by_hand = kubetrain("train", *sets("train.micro_batch_size=16", "train.grad_accum_steps=4", *common,
                                       "run.name=hand"), cwd=tmp_path)
    assert "micro-batch" not in by_hand.stdout.split("model:")[0]
    # the confirming step moved neither the weights, nor the dropout RNG, nor the data: the same losses, bitwise
    assert _losses(tmp_path / "runs" / "auto") == _losses(tmp_path / "runs" / "hand")
    recorded = (tmp_path / "runs" / "auto" / "config.yaml").read_text()
    assert "micro_batch_size: 16" in recorded and "grad_accum_steps: 4" in recorded  # the resolved config


def test_a_dry_run_and_doctor_say_the_choice(workdir: Path) -> None:
    from kubetrain.doctor import doctor, render

    cfg = load_config(None, None, [*AUTO, "train.memory_budget_gib=0.5"])
    report = doctor(cfg)
    assert report["micro_batch"]["micro_batch_size"] == 64 and report["micro_batch"]["fits"]
    assert report["settings"]["micro_batch_size"] == 64 and report["settings"]["grad_accum_steps"] == 1
    assert "micro-batch: 64 (auto: the largest of 64, 32" in render(report)
    said: list[str] = []
    train(cfg, log=said.append, dry_run=True)
    line = next(x for x in said if x.startswith("micro-batch "))
    assert line.startswith("micro-batch 64 x 1 accum x 1 process = global batch 64 (auto: ")
    assert line.endswith("a run confirms it by one training step)")
    assert not (workdir / "runs" / "tiny").exists()


@pytest.mark.slow
def test_a_resume_that_chooses_another_micro_batch_keeps_the_batch_and_the_data(tmp_path: Path) -> None:
    budget_gib = (need_at(AUTO, 16) + MIB // 10) / 2**30  # 16 fits, 32 does not
    common = [*AUTO[len(TINY):], "checkpoint.every_steps=2", "eval.every_steps=2"]
    kubetrain("train", *sets(*common, "run.name=r", "train.max_steps=2", "train.memory_budget_gib=1"),
              cwd=tmp_path)
    again = kubetrain("train", *sets(*common, "run.name=r", "train.max_steps=4",
                                     f"train.memory_budget_gib={budget_gib}"), "--json", cwd=tmp_path)
    assert "config changed since the last start: train.micro_batch_size: 64 -> 16" in again.stdout
    assert "config changed since the last start: train.grad_accum_steps: 1 -> 4" in again.stdout
    assert json.loads(again.stdout.splitlines()[-1])["tokens"] == 4 * 64 * 32  # the global batch was kept
    whole = kubetrain("train", *sets(*common, "run.name=whole", "train.max_steps=4", "train.memory_budget_gib=1"),
                      cwd=tmp_path)
    assert "micro-batch 64 x 1 accum" in whole.stdout
    resumed, straight = _losses(tmp_path / "runs" / "r"), _losses(tmp_path / "runs" / "whole")
    assert len(resumed) == len(straight) == 4
    assert resumed[:2] == straight[:2]
    # the same windows in the same order, summed as 4 micro-batches of 16 instead of one of 64
    assert resumed[2:] == pytest.approx(straight[2:], abs=1e-5)


# --- out of memory on one rank under FSDP ---------------------------------------------------------------------


def _fsdp_ranks(rank: int, world: int, root: str) -> None:
    """One of 2 gloo ranks under FSDP: the confirming step of micro-batch 4 runs out of memory on rank 1 only, in
    the second block's forward (after FSDP gathered its weights), while rank 0 goes on to gather the next block's;
    then one real step. A second Trainer takes the same step without a confirming step before it."""
    import datetime

    import torch.distributed as td

    from kubetrain.train.micro_batch import confirm_on_model
    from kubetrain.train.micro_batch_choice import MicroBatchChoice

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    # a mismatched collective fails within a minute instead of hanging the suite
    td.init_process_group("gloo", init_method=f"file://{root}/store", rank=rank, world_size=world,
                          timeout=datetime.timedelta(seconds=60))
    try:
        overrides = [*TINY, "dist.strategy=fsdp", "train.global_batch_size=8", f"run.output_dir={root}/runs",
                     f"data.cache_dir={root}/cache", "eval.sample_prompt=null"]
        cfg = with_batch(load_config(None, None, overrides), 4, 1)
        choice = MicroBatchChoice(4, (4, 2, 1), need=0, budget=1, fits=True, budget_from="stated by the test")

        def out_of_memory(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            if args[0].shape[0] > 2:
                raise torch.OutOfMemoryError("out of memory (the test's, on rank 1 at micro-batch 4)")

        results = []
        for confirmed in (True, False):
            named = cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": f"confirmed-{confirmed}"})})
            trainer = Trainer(named, RunOptions(argv=[], resume="never"), log=lambda m: None)
            trainer.setup()
            trainer.open()
            line = ""
            if confirmed:
                hook = trainer.model.blocks[1].register_forward_pre_hook(out_of_memory) if rank == 1 else None
                chosen, line = confirm_on_model(cfg, choice, trainer.model, trainer.train_windows, CPU,
                                                autocast("fp32", CPU), world, loss_of=trainer.loss_of)
                if hook is not None:
                    hook.remove()
                line = f"{chosen.train.micro_batch} {chosen.train.grad_accum_steps} {line}"
            trainer.train_step()  # FSDP's own collectives again: every rank gathers, scatters and steps
            loss = trainer.logged_loss.read_and_reset()
            weights = {n: p.full_tensor().clone() for n, p in trainer.model.named_parameters()}
            results.append((line, loss, weights))
        if rank == 1:
            torch.save(results, Path(root) / "results.pt")
    finally:
        td.destroy_process_group()


@pytest.mark.slow  # 2 processes, 2 Trainers each (about 30 s here)
def test_one_rank_out_of_memory_under_fsdp_steps_every_rank_down_without_a_hang(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_fsdp_ranks, args=(2, str(tmp_path)), nprocs=2)
    (line, loss, weights), (_, plain_loss, plain_weights) = torch.load(tmp_path / "results.pt", weights_only=True)
    micro, accum, said = line.split(" ", 2)
    assert (micro, accum) == ("2", "2")  # every rank stepped down to 2, the global batch kept (2 x 2 x 2 = 8)
    assert said.startswith("micro-batch 2 x 2 accum x 2 processes = global batch 8 (auto: ")
    assert said.endswith("4 ran out of memory in the confirming step)")
    # FSDP's own collectives came back, and the confirming step left nothing behind: the step after it is the step
    # of a run that never confirmed
    assert loss == plain_loss
    assert weights.keys() == plain_weights.keys()
    assert all(torch.equal(weights[n], w) for n, w in plain_weights.items())

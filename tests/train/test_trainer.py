"""The Trainer: through the real CLI (resume modes, refusal of foreign checkpoints, logged config changes), and
each of its parts on its own."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from kubetrain.config.loading import validate
from kubetrain.config.schema import Config
from kubetrain.errors import TrainingFailed
from kubetrain.train.trainer import RunOptions, Trainer
from tests.train.conftest import kubetrain, sets


@pytest.mark.slow
def test_resume_modes_and_incompatible_checkpoints(tmp_path: Path) -> None:
    base = sets("run.name=r", "train.max_steps=4", "checkpoint.every_steps=2", "eval.every_steps=2")
    kubetrain("train", *base, cwd=tmp_path)
    run = tmp_path / "runs" / "r"

    # the same command again continues the same run: nothing left to do, same step
    again = kubetrain("train", *base, "--set", "train.max_steps=6", "--set", "train.lr=0.001", "--json", cwd=tmp_path)
    assert "resuming from" in again.stdout and "step 4" in again.stdout
    assert "config changed since the last start: train.lr: 0.003 -> 0.001" in again.stdout
    assert json.loads(again.stdout.splitlines()[-1])["steps"] == 6
    meta = json.loads((run / "meta.json").read_text())
    assert meta["starts"] == 2 and any("train.lr" in c for c in meta["config_changes"])

    # never: refuses to overwrite a run that has checkpoints
    never = kubetrain("train", *base, "--resume", "never", cwd=tmp_path, check=False)
    assert never.returncode == 2 and "already has checkpoints" in never.stderr

    # a different model shape is refused with a clear message and the run is untouched
    wider = kubetrain("train", *base, "--set", "train.max_steps=8", "--set", "model.n_embd=48", cwd=tmp_path,
                      check=False)
    assert wider.returncode == 2, wider.stderr
    assert wider.stderr.startswith("error: checkpoint") and "does not fit the model" in wider.stderr
    assert "Traceback" not in wider.stderr
    assert (run / "checkpoints" / "step-000006" / "meta.json").is_file()

    # a different tokenizer is refused too
    (tmp_path / "t.txt").write_text("hello world, hello tokens. " * 400)
    bpe = kubetrain("train", *base, "--set", "train.max_steps=8", "--set", "data.tokenizer.kind=bpe",
                    "--set", "data.tokenizer.vocab_size=300", "--set", "model.vocab_size=256", cwd=tmp_path,
                    check=False)
    assert bpe.returncode == 2 and "tokenizer" in bpe.stderr

    # PATH: a new run warm-started from another run's checkpoint continues its step count
    other = kubetrain("train", *sets("run.name=other", "train.max_steps=8"), "--resume",
                      str(run / "checkpoints" / "step-000006"), "--json", cwd=tmp_path)
    assert json.loads(other.stdout.splitlines()[-1])["resumed_from"] == 6
    missing = kubetrain("train", *base, "--resume", "nope/step-1", cwd=tmp_path, check=False)
    assert missing.returncode == 2 and "no such checkpoint" in missing.stderr


# --- the Trainer's parts, each on its own (in-process, one tiny model) -------------------------------------


def tiny_config(root: Path, **train: Any) -> Config:
    return validate({
        "run": {"name": "parts", "output_dir": str(root), "threads": 1},
        "model": {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16},
        "train": {"max_steps": 3, "micro_batch_size": 2, "grad_accum_steps": 2, "warmup_steps": 1,
                  "log_every_steps": 1, **train},
        "eval": {"every_steps": 100, "windows": 1, "sample_tokens": 4},
        "checkpoint": {"every_steps": 100},
        "track": {"console": False},
    })


def opened(root: Path, **train: Any) -> Trainer:
    trainer = Trainer(tiny_config(root, **train), RunOptions(argv=[]), log=lambda m: None)
    trainer.setup()
    trainer.open()
    return trainer


def test_dry_run_writes_nothing(tmp_path: Path) -> None:
    trainer = Trainer(tiny_config(tmp_path), RunOptions(dry_run=True), log=lambda m: None)
    result = trainer.run()
    assert result.status == "dry-run" and result.final_train_loss is not None
    # an untrained model predicts about uniformly: the loss is near ln(vocab)
    assert abs(result.final_train_loss - math.log(trainer.tokenizer.vocab_size)) < 1.0
    assert not (tmp_path / "parts").exists()


def test_train_step_moves_weights_counters_and_the_loss_window(tmp_path: Path) -> None:
    trainer = opened(tmp_path)
    before = {k: v.clone() for k, v in trainer.base.state_dict().items()}
    trainer.train_step()
    assert (trainer.state.step, trainer.state.tokens) == (1, 2 * 2 * 16)
    loss_sum, counted = trainer.logged_loss.sums.tolist()
    assert trainer.logged_loss.steps == 1 and loss_sum > 0 and counted == 2 * 2 * 16  # unmasked: every token counts
    assert any(not torch.equal(before[k], v) for k, v in trainer.base.state_dict().items())
    trainer.log_train()
    assert trainer.state.last_train_loss == pytest.approx(loss_sum / counted)
    assert trainer.logged_loss.steps == 0 and not trainer.logged_loss.sums.any()
    records = [json.loads(line) for line in (tmp_path / "parts" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1]


def test_gradient_checkpointing_of_our_gpt_trains_the_same_weights(tmp_path: Path) -> None:
    """model.gradient_checkpointing is applied to each block of kind gpt (it used to be ignored), same numbers."""
    trainers = []
    for checkpointed in (False, True):
        raw = tiny_config(tmp_path / str(checkpointed)).model_dump()
        # with dropout: a recomputed block must draw the same masks
        raw["model"].update(n_layer=2, dropout=0.1, gradient_checkpointing=checkpointed)
        cfg = validate(raw)
        trainer = Trainer(cfg, RunOptions(argv=[]), log=lambda m: None)
        trainer.setup()
        trainer.open()
        trainer.train_step()
        trainers.append(trainer)
    plain, checkpointed_run = trainers
    assert torch.equal(plain.logged_loss.sums, checkpointed_run.logged_loss.sums)
    for name, weight in plain.base.state_dict().items():
        torch.testing.assert_close(checkpointed_run.base.state_dict()[name], weight, rtol=0, atol=1e-6)
    from torch.distributed._composable import checkpoint

    assert all(checkpoint.state(block) is not None for block in checkpointed_run.base.blocks)


def test_evaluate_reports_only_improvements(tmp_path: Path) -> None:
    trainer = opened(tmp_path)
    assert trainer.evaluate() is True
    first = trainer.state.best_val_loss
    assert first is not None and trainer.state.last_val_loss == first
    assert trainer.evaluate() is False  # same weights, same batches: not better
    assert trainer.state.best_val_loss == first


def test_save_then_a_new_trainer_resumes_the_same_state(tmp_path: Path) -> None:
    trainer = opened(tmp_path)
    trainer.train_step()
    trainer.train_step()
    saved = trainer.save(is_best=True)
    assert saved is not None and saved.path.name == "step-000002" and trainer.last_checkpoint == saved
    trainer.finish("stopped")
    meta = json.loads((tmp_path / "parts" / "meta.json").read_text())
    assert meta["status"] == "stopped"
    assert meta["device"].startswith("cpu") and meta["peak_flops"] is None  # no MFU on a CPU

    again = opened(tmp_path)
    assert again.resumed is not None and again.resumed.path == saved.path
    assert (again.state.step, again.state.tokens) == (2, trainer.state.tokens)
    assert again.loader.state_dict() == trainer.loader.state_dict()
    for k, v in trainer.base.state_dict().items():
        assert torch.equal(v, again.base.state_dict()[k]), k
    assert again.run().steps == 3


@pytest.mark.parametrize("save_best", [False, True])
def test_checkpoints_follow_the_interval_and_best_moves_among_saved_ones(tmp_path: Path, save_best: bool) -> None:
    cfg = tiny_config(tmp_path, max_steps=7)
    cfg = cfg.model_copy(update={
        "eval": cfg.eval.model_copy(update={"every_steps": 1, "sample_prompt": None}),
        "checkpoint": cfg.checkpoint.model_copy(update={"every_steps": 3, "keep_last": 10, "save_best": save_best}),
    })
    Trainer(cfg, RunOptions(argv=[]), log=lambda m: None).run()
    run = tmp_path / "parts"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    vals = {r["step"]: r["val_loss"] for r in records if r["kind"] == "eval"}
    improving = {s for s in vals if vals[s] < min((v for t, v in vals.items() if t < s), default=math.inf)}
    saved = {int(p.name.removeprefix("step-")) for p in (run / "checkpoints").glob("step-*")}
    assert saved == ({3, 6, 7} | improving if save_best else {3, 6, 7})  # the interval, the end (+ improvements)
    best = (run / "checkpoints" / "best").read_text().strip()
    assert best == f"step-{min(saved, key=lambda s: vals[s]):06d}"
    assert [r["best"] for r in records if r["kind"] == "checkpoint"].count(True) >= 1


def test_max_tokens_ends_the_run_at_the_lr_floor(tmp_path: Path) -> None:
    # 3 steps of 64 tokens: the run ends at step 3 of max_steps 50, and the last step's lr is the floor
    result = Trainer(tiny_config(tmp_path, max_steps=50, max_tokens=3 * 64, warmup_steps=0, min_lr=1e-5),
                     RunOptions(argv=[]), log=lambda m: None).run()
    assert result.steps == 3
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "parts" / "metrics.jsonl").read_text().splitlines()
           if json.loads(line)["kind"] == "train"]
    assert lrs[-1] == pytest.approx(1e-5)  # the floor, on the last step that trains
    assert lrs[1] == pytest.approx(1e-5 + 0.5 * (3e-3 - 1e-5))  # halfway down the cosine
    assert lrs == sorted(lrs, reverse=True)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_on_the_cpu(tmp_path: Path, precision: str) -> None:
    trainer = Trainer(tiny_config(tmp_path, precision=precision), RunOptions(argv=[]), log=lambda m: None)
    result = trainer.run()
    assert result.status == "finished" and result.final_train_loss is not None
    assert math.isfinite(result.final_train_loss)
    assert trainer.scaler.is_enabled() == (precision == "fp16")


def test_fp16_counts_skipped_steps_and_resumes_the_scaler(tmp_path: Path) -> None:
    trainer = opened(tmp_path, precision="fp16")
    # a loss scale far past fp16's range: the gradients overflow, the step is skipped, the scale shrinks
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, growth_interval=1000)
    trainer.scaler = trainer.checkpointer.scaler = scaler  # the checkpointer saves the scaler it was given
    before = {k: v.clone() for k, v in trainer.base.state_dict().items()}
    trainer.train_step()
    assert trainer.state.step == 1 and trainer.scaler.get_scale() == 2.0**39
    assert all(torch.equal(before[k], v) for k, v in trainer.base.state_dict().items())
    trainer.log_train()  # skipped steps are counted at log time: no host sync per step
    assert trainer.state.skipped_steps == 1
    trainer.train_step()  # the scale (2**39) still overflows: skipped again, counted by save
    trainer.scaler.update(2.0**4)
    trainer.train_step()  # within range: a real step
    trainer.save()
    assert trainer.state.skipped_steps == 2 and trainer.state.step == 3
    records = [json.loads(line) for line in (tmp_path / "parts" / "metrics.jsonl").read_text().splitlines()]
    train = next(r for r in records if r["kind"] == "train")
    assert train["skipped_steps"] == 1 and train["loss_scale"] == 2.0**39
    again = opened(tmp_path, precision="fp16")
    assert again.state.skipped_steps == 2 and again.scaler.get_scale() == trainer.scaler.get_scale()


def test_sample_prompt_null_turns_every_sample_off(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, max_steps=2)
    cfg.eval.sample_prompt = None  # the eval at the last step and the end of the run generate nothing
    result = Trainer(cfg, RunOptions(argv=[]), log=lambda m: None).run()
    assert result.status == "finished" and result.final_val_loss is not None
    assert result.sample is None
    assert not (tmp_path / "parts" / "samples.txt").exists()
def test_a_background_save_is_recorded_once_written_with_its_timings(tmp_path: Path) -> None:
    trainer = opened(tmp_path)
    trainer.train_step()
    assert trainer.save(background=True) is None  # written by a thread from a host copy
    trainer.train_step()  # training goes on; the copy does not change
    trainer.checkpointer.collect_saves(wait=True)
    assert trainer.last_checkpoint is not None and trainer.last_checkpoint.path.name == "step-000001"
    lines = [json.loads(line) for line in (tmp_path / "parts" / "metrics.jsonl").read_text().splitlines()]
    [ckpt] = [r for r in lines if r["kind"] == "checkpoint"]
    assert ckpt["step"] == 1 and ckpt["write_seconds"] >= ckpt["blocked_seconds"] > 0
    again = opened(tmp_path)
    assert again.state.step == 1  # the checkpoint holds step 1, not what the loop did after


class MetaLostAfterStep1(Trainer):
    """meta.json cannot be written after the first step (here: a folder took its place; a lost mount or
    permission looks the same to the writer)."""

    def train_step(self) -> None:
        super().train_step()
        if self.state.step == 1:
            meta = self.path / "meta.json"
            meta.unlink()
            meta.mkdir()


def test_an_io_error_while_running_is_a_failure_not_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trainer = MetaLostAfterStep1(tiny_config(tmp_path, max_steps=2), RunOptions(argv=[]))
    with pytest.raises(TrainingFailed, match=r"failed while running at step 2: Is a directory: .*meta.json") as e:
        trainer.run()
    assert e.value.exit_code == 1
    assert "warning: could not record the end of the run (failed)" in capsys.readouterr().out
    assert (tmp_path / "parts" / "checkpoints" / "step-000002").is_dir()  # what was written stays


def test_the_logged_loss_is_the_mean_of_the_steps_it_covers(tmp_path: Path) -> None:
    """The loss is read from the device only at log steps: a window of 4 steps logs the mean of the 4 losses
    that a run logging every step shows (same machine, same process: the runs are identical up to logging)."""

    def losses(name: str, every: int) -> dict[int, float]:
        cfg = tiny_config(tmp_path / name, max_steps=8, log_every_steps=every)
        Trainer(cfg, RunOptions(argv=[]), log=lambda m: None).run()
        lines = (tmp_path / name / "parts" / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"}

    each, windows = losses("each", 1), losses("windows", 4)
    assert sorted(each) == list(range(1, 9)) and sorted(windows) == [4, 8]
    for end in (4, 8):
        assert windows[end] == pytest.approx(sum(each[s] for s in range(end - 3, end + 1)) / 4, rel=1e-6)


class OutOfMemoryWhileWrapping(Trainer):
    """The model does not fit where it goes (here: a petabyte asked of the CPU allocator while opening)."""

    def open(self) -> None:
        torch.empty(2**50, dtype=torch.uint8)


def test_out_of_memory_before_the_first_step_is_one_line_too(tmp_path: Path) -> None:
    trainer = OutOfMemoryWhileWrapping(tiny_config(tmp_path), RunOptions(argv=[]), log=lambda m: None)
    with pytest.raises(TrainingFailed, match=r"^out of memory while setting up: lower train\.micro_batch_size"):
        trainer.run()


class OutOfMemoryAtStep3(Trainer):
    """Step 3 asks the allocator for a petabyte: a real allocation failure (the CPU's; CUDA's is another class)."""

    def train_step(self) -> None:
        if self.state.step == 2:
            torch.empty(2**50, dtype=torch.uint8)
        super().train_step()


def test_out_of_memory_is_one_line_naming_what_to_change_and_keeps_the_checkpoint(tmp_path: Path) -> None:
    trainer = OutOfMemoryAtStep3(tiny_config(tmp_path, max_steps=4), RunOptions(argv=[]), log=lambda m: None)
    trainer.cfg.checkpoint.every_steps = 2
    with pytest.raises(TrainingFailed) as e:
        trainer.run()
    message = str(e.value)
    assert e.value.exit_code == 1 and "\n" not in message
    assert message.startswith("out of memory after step 2: lower train.micro_batch_size (2; ")
    assert "model.gradient_checkpointing: true" in message and "dist.strategy: fsdp" in message
    assert (tmp_path / "parts" / "checkpoints" / "step-000002").is_dir()
    assert json.loads((tmp_path / "parts" / "meta.json").read_text())["status"] == "failed"


def test_out_of_memory_advice_follows_the_config() -> None:
    from kubetrain.config import load_config
    from kubetrain.train.device import is_out_of_memory, out_of_memory_advice

    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    lean = load_config(overrides=["train.micro_batch_size=1", "model.gradient_checkpointing=true",
                                  "dist.strategy=fsdp"])
    assert out_of_memory_advice(lean, "cuda", "after step 7", 8).startswith(
        "CUDA out of memory after step 7: use a smaller model.block_size or more GPUs")
    fp32 = out_of_memory_advice(load_config(overrides=["train.precision=fp32"]), "cuda", "while setting up", 1)
    assert "over more GPUs" in fp32 and "precision auto" in fp32


def test_samples_and_the_default_log_hide_secret_looking_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    secret = "hf_" + "A1b2C3d4E5f6G7h8I9j0"
    cfg = tiny_config(tmp_path, max_steps=1)
    cfg.eval.sample_prompt = f"token {secret} says"
    cfg.eval.every_steps = 1
    Trainer(cfg, RunOptions(argv=[])).run()
    samples = (tmp_path / "parts" / "samples.txt").read_text()
    assert "says" in samples and secret not in samples
    trainer = Trainer(cfg, RunOptions(argv=[]))
    trainer.say(f"a line with {secret}")
    assert secret not in capsys.readouterr().out


@pytest.mark.slow
def test_an_fsdp_run_samples_at_each_evaluation_and_at_the_end(tmp_path: Path) -> None:
    """Every rank takes part in the sample's forwards (FSDP all-gathers the weights); rank 0 writes and prints it."""
    done = kubetrain("train", *sets("run.name=fsdp", "dist.strategy=fsdp", "train.max_steps=4", "eval.every_steps=2",
                                    "checkpoint.every_steps=4", "eval.sample_prompt=And God said"),
                     "--nproc", "2", cwd=tmp_path)
    assert "--- sample ---\nAnd God said" in done.stdout
    records = [json.loads(line) for line in (tmp_path / "runs" / "fsdp" / "samples.txt").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4] and all(r["sample"].startswith("And God said") for r in records)

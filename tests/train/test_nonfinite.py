"""train.nonfinite: a step whose loss or gradients are not finite changes no weight and no optimizer state; a run whose
steps stay so stops with one line naming a checkpoint whose weights gave a finite loss; no checkpoint ever holds a
tensor that is not finite. A run that ends, or is stopped, on such a step saves the weights of its last step taken:
`train.max_nonfinite_steps` in a row alone fail a run."""

from __future__ import annotations

import json
import math
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from kubetrain import checkpoint
from kubetrain.config.loading import validate
from kubetrain.config.schema import Config
from kubetrain.data.loader import Batch
from kubetrain.errors import EXIT_STOPPED_RESUMABLE, RepeatableFailure, TrainingStopped
from kubetrain.train.trainer import RunOptions, Trainer
from tests.conftest import RunMain
from tests.train.conftest import kubetrain, sets

# lr 1e30 (no warmup): the first update sends the weights to ~1e30, and the gradients of the next steps overflow
EXPLODING = sets("train.max_steps=20", "train.warmup_steps=0", "train.lr=1e30", "checkpoint.every_steps=1",
                 "eval.every_steps=5", "run.name=nan")
STOP_LINE = re.compile(
    r"error: the loss or its gradients were not finite \(NaN or inf\) for (\d+) steps in a row, since step (\d+): "
    r"stopped at step (\d+) \(those steps changed no weight\); the newest checkpoint whose weights gave a finite loss "
    r"is (\S+): run the same command with a lower --set train\.lr=\.\.\. \(--resume auto goes on from (\S+), "
    r"passing by the checkpoints after it\), or check the data\n")
MARK = 0  # a byte the builtin corpus never holds: a window with it gives inf (the embedding hook of `crafted`)


def saved_tensors(ckpt: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor a checkpoint folder holds: its safetensors files and the tensors of its .pt files."""
    for path in sorted(ckpt.rglob("*")):
        if path.suffix == ".safetensors":
            yield from ((f"{path.name}:{k}", v) for k, v in load_file(path).items())
        elif path.suffix == ".pt":
            stack: list[Any] = [torch.load(path, weights_only=True)]
            while stack:
                item = stack.pop()
                if isinstance(item, torch.Tensor):
                    yield path.name, item
                elif isinstance(item, dict):
                    stack += item.values()
                elif isinstance(item, (list, tuple)):
                    stack += item


def assert_every_saved_tensor_is_finite(ckpt_root: Path) -> None:
    ckpts = checkpoint.complete_checkpoints(ckpt_root)
    assert ckpts
    for ckpt in ckpts:
        tensors = list(saved_tensors(ckpt))
        assert any(name.startswith("model") for name, _ in tensors), ckpt
        for name, t in tensors:
            assert not t.is_floating_point() or bool(torch.isfinite(t).all()), f"{ckpt.name}: {name}"


def config(root: Path, **train: Any) -> Config:
    return validate({
        "run": {"name": "guard", "output_dir": str(root), "threads": 1},
        "model": {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16},
        "train": {"max_steps": 6, "micro_batch_size": 2, "grad_accum_steps": 2, "warmup_steps": 0,
                  "log_every_steps": 1, **train},
        "eval": {"every_steps": 100, "windows": 2, "sample_prompt": None},
        "checkpoint": {"every_steps": 1, "keep_last": 10, "async_save": False},
        "track": {"console": False},
    })


def crafted(trainer: Trainer, bad_steps: set[int]) -> None:
    """The windows of `bad_steps` (1-based) carry the byte MARK, whose embedding the model makes inf: data that
    gives an inf loss whatever the weights (on its first micro-batch; the others stay as the corpus has them)."""
    trainer.base.embed.register_forward_hook(  # type: ignore[union-attr]
        lambda module, args, out: out.masked_fill((args[0] == MARK).unsqueeze(-1), float("inf")))
    fetch = trainer.loader.next_batch
    marked: set[int] = set()

    def next_batch() -> Batch:  # the step's window is fetched before the step counts
        batch, step = fetch(), trainer.state.step + 1
        if step in bad_steps and step not in marked:
            batch.input_ids[0, 3] = MARK
            marked.add(step)
        return batch

    trainer.loader.next_batch = next_batch  # type: ignore[method-assign]


def opened(root: Path, **train: Any) -> Trainer:
    trainer = Trainer(config(root, **train), RunOptions(argv=[]), log=lambda m: None)
    trainer.setup()
    trainer.open()
    return trainer


def state_of(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Weights and optimizer state (moments and step counts), copied."""
    out = {f"w.{k}": v.clone() for k, v in trainer.base.state_dict().items()}
    for i, state in trainer.optimizer.state_dict()["state"].items():
        out.update({f"o.{i}.{k}": v.clone() for k, v in state.items()})
    return out


@pytest.mark.parametrize("what, fused, clip", [("loss", True, 1.0), ("loss", True, 0.0), ("gradient", True, 1.0),
                                               ("loss", False, 1.0)])
def test_a_step_that_is_not_finite_changes_no_weight_and_no_optimizer_state(
    tmp_path: Path, what: str, fused: bool, clip: float
) -> None:
    trainer = opened(tmp_path, grad_clip=clip)
    if not fused:  # an optimizer without the fused kernel's found_inf (MPS's foreach): the host reads the flag
        trainer.optimizer = torch.optim.AdamW(trainer.model.parameters(), lr=1e-3, foreach=True)
    trainer.train_step()
    before = state_of(trainer)
    if what == "loss":
        crafted(trainer, {2})
    else:  # a finite loss whose gradient overflows on the way back
        handle = trainer.base.lm_head.weight.register_hook(lambda g: g * float("inf"))  # type: ignore[union-attr]
    trainer.train_step()
    loss_of_the_bad_step = trainer.logged_loss.read_and_reset()
    assert trainer.state.step == 2
    after = state_of(trainer)
    assert after.keys() == before.keys()
    assert [k for k, v in before.items() if not torch.equal(after[k], v)] == []
    assert math.isnan(loss_of_the_bad_step) == (what == "loss")  # the log shows the loss as it was
    if what == "gradient":
        handle.remove()
    trainer.train_step()  # the next window trains as usual
    assert any(not torch.equal(state_of(trainer)[k], v) for k, v in before.items() if k.startswith("w."))
    trainer.log_train()
    assert trainer.state.skipped_steps == 1 and math.isfinite(trainer.state.last_train_loss or math.nan)
    assert int(trainer.guard.streak) == 0  # one bad step, then a good one: no streak left


def test_windows_that_stay_inf_stop_the_run_naming_the_checkpoint_before_them(tmp_path: Path) -> None:
    class InfFromStep3(Trainer):
        def open(self) -> None:
            super().open()
            crafted(self, {3, 4, 5})

    trainer = InfFromStep3(config(tmp_path, max_nonfinite_steps=3), RunOptions(argv=[]), log=lambda m: None)
    with pytest.raises(RepeatableFailure) as failed:
        trainer.run()
    ckpts = tmp_path / "guard" / "checkpoints"
    # the loss of step 3 is computed on step 2's weights: only step 1's are proven to give a finite loss
    match = STOP_LINE.fullmatch(f"error: {failed.value}\n")
    assert match and match.group(1, 2, 3) == ("3", "3", "5"), str(failed.value)
    assert match.group(4) == str(ckpts / "step-000001") and match.group(5) == "step-000001"
    # steps 3 to 5 changed nothing and saved nothing; every checkpoint written holds finite tensors only
    assert [p.name for p in checkpoint.complete_checkpoints(ckpts)] == ["step-000001", "step-000002"]
    assert_every_saved_tensor_is_finite(ckpts)
    assert json.loads((tmp_path / "guard" / "meta.json").read_text())["status"] == "failed"


def test_a_diverging_run_stops_naming_a_checkpoint_that_resumes_with_finite_losses(
    run_main: RunMain, tmp_cwd: Path
) -> None:
    args = [*sets("run.name=nan", "train.warmup_steps=0", "checkpoint.every_steps=1", "checkpoint.keep_last=20",
                  "eval.every_steps=2", "train.max_nonfinite_steps=3")]
    assert run_main("train", *args, "--set", "train.max_steps=3")[0] == 0  # 3 sane steps
    code, out, err = run_main("train", *args, "--set", "train.max_steps=20", "--set", "train.lr=1e30")
    assert code == 1 and "Traceback" not in out + err
    match = STOP_LINE.fullmatch(err)
    assert match, err
    n, first, stopped, named, resume = match.groups()
    assert (n, int(stopped)) == ("3", int(first) + 2)
    # the checkpoint named holds weights whose loss a step computed, finite: saved before the step before the first
    # bad one (whose weights, a checkpoint may hold, gave the first loss that was not finite)
    assert Path(named).name == resume and int(Path(named).name.split("-")[1]) < int(first) - 1
    ckpts = tmp_cwd / "runs" / "nan" / "checkpoints"
    assert_every_saved_tensor_is_finite(ckpts)
    assert checkpoint.pointer(ckpts, "latest") != resume  # latest holds the (finite, huge) weights that led there

    # the command the line gives: the same one, a sane train.lr, --resume auto (the default) from the named one
    code, out, err = run_main("train", *args, "--set", f"train.max_steps={int(stopped) + 2}")
    assert code == 0, err
    assert "its weights gave a loss that was not finite" in out + err and f"resuming from {named} " in out + err
    resumed_at = int(Path(named).name.split("-")[1])
    records = [json.loads(line) for line in (tmp_cwd / "runs" / "nan" / "metrics.jsonl").read_text().splitlines()]
    after = [r["loss"] for r in records if r["kind"] == "train" and r["step"] > resumed_at]
    assert len(after) == int(stopped) + 2 - resumed_at and all(math.isfinite(x) for x in after)
    assert_every_saved_tensor_is_finite(ckpts)


def saved_state(ckpt: Path) -> dict[str, torch.Tensor]:
    """The weights and the optimizer's tensors (moments, step counts) a checkpoint holds."""
    state = {f"model.{k}": v for k, v in load_file(ckpt / "model.safetensors").items()}
    state.update((k, v) for k, v in load_file(ckpt / "trainer.safetensors").items() if k.startswith("optimizer."))
    return state


def assert_same_state(ckpt: Path, before: Path) -> None:
    found, expected = saved_state(ckpt), saved_state(before)
    assert found.keys() == expected.keys() and any(k.startswith("optimizer.") for k in found)
    assert [k for k, v in expected.items() if not torch.equal(found[k], v)] == [], f"{ckpt.name} != {before.name}"


def test_a_run_whose_last_step_is_not_finite_ends_saving_the_weights_before_it(tmp_path: Path) -> None:
    class InfAtTheEnd(Trainer):
        def open(self) -> None:
            super().open()
            crafted(self, {6})

    result = InfAtTheEnd(config(tmp_path), RunOptions(argv=[]), log=lambda m: None).run()
    assert result.status == "finished" and result.steps == 6
    ckpts = tmp_path / "guard" / "checkpoints"
    # the last step changed no weight: the checkpoint of the end holds those of step 5, and is the one to resume
    assert checkpoint.pointer(ckpts, "latest") == "step-000006"
    assert checkpoint.verify(ckpts / "step-000006").step == 6
    assert_same_state(ckpts / "step-000006", ckpts / "step-000005")
    assert_every_saved_tensor_is_finite(ckpts)
    assert json.loads((tmp_path / "guard" / "meta.json").read_text())["status"] == "finished"


def test_a_run_that_ends_on_skipped_steps_saves_its_last_weights_taken_and_exits_0(
    run_main: RunMain, tmp_cwd: Path
) -> None:
    # lr 1e30: step 1's update sends the weights to ~1e30 (finite), and every later step's gradients overflow
    code, out, err = run_main("train", *EXPLODING, "--set", "train.max_steps=4")  # below the default of 5 steps
    assert code == 0, err
    assert "warning: the last 3 steps (to step 4) changed no weight: the loss or its gradients were not finite " \
           "(NaN or inf); step 4's checkpoint holds the weights of step 1, not evaluated" in out
    assert "--- sample ---" not in out  # weights whose loss was not finite: no sample of them
    ckpts = tmp_cwd / "runs" / "nan" / "checkpoints"
    assert [p.name for p in checkpoint.complete_checkpoints(ckpts)] == ["step-000001", "step-000004"]
    assert_same_state(ckpts / "step-000004", ckpts / "step-000001")
    assert_every_saved_tensor_is_finite(ckpts)


def test_a_stop_at_a_step_that_is_not_finite_saves_exits_resumable_and_the_streak_goes_on(tmp_path: Path) -> None:
    class StoppedAtStep4(Trainer):
        def open(self) -> None:
            super().open()
            crafted(self, {3, 4})

        def train_step(self) -> None:
            if self.state.step + 1 == 4:  # SIGTERM during step 4, the second not finite in a row
                os.kill(os.getpid(), signal.SIGTERM)
            super().train_step()

    with pytest.raises(TrainingStopped) as stopped:
        StoppedAtStep4(config(tmp_path, max_nonfinite_steps=3), RunOptions(argv=[]), log=lambda m: None).run()
    assert stopped.value.exit_code == EXIT_STOPPED_RESUMABLE == 75  # a preempted pod is restarted, not failed
    assert "stopped by SIGTERM at step 4; checkpoint step-000004" in str(stopped.value)
    ckpts = tmp_path / "guard" / "checkpoints"
    assert checkpoint.pointer(ckpts, "latest") == "step-000004"
    assert_same_state(ckpts / "step-000004", ckpts / "step-000002")  # steps 3 and 4 changed nothing
    assert_every_saved_tensor_is_finite(ckpts)

    # resumed: the streak of steps 3 and 4 goes on, so a third in a row is max_nonfinite_steps (3)
    class InfAtStep5(Trainer):
        def open(self) -> None:
            super().open()
            crafted(self, {5})

    with pytest.raises(RepeatableFailure) as failed:
        InfAtStep5(config(tmp_path, max_nonfinite_steps=3), RunOptions(argv=[]), log=lambda m: None).run()
    match = STOP_LINE.fullmatch(f"error: {failed.value}\n")
    assert match and match.group(1, 2, 3) == ("3", "3", "5"), str(failed.value)
    assert match.group(4) == str(ckpts / "step-000001")  # step 2's weights gave step 3's loss; step 4 holds them


def test_a_streak_that_reaches_the_limit_at_the_last_step_still_fails(tmp_path: Path) -> None:
    class InfAtTheEnd(Trainer):
        def open(self) -> None:
            super().open()
            crafted(self, {4, 5, 6})

    with pytest.raises(RepeatableFailure, match="for 3 steps in a row, since step 4: stopped at step 6"):
        InfAtTheEnd(config(tmp_path, max_nonfinite_steps=3), RunOptions(argv=[]), log=lambda m: None).run()
    ckpts = tmp_path / "guard" / "checkpoints"
    assert [p.name for p in checkpoint.complete_checkpoints(ckpts)][-1] == "step-000003"


def test_under_fp16_the_scalers_overflows_count_in_the_streak(tmp_path: Path) -> None:
    class Overflowing(Trainer):
        def open(self) -> None:
            super().open()
            # a loss scale far past fp16's range: every gradient overflows, each step halves the scale and is skipped
            self.scaler = self.checkpointer.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**100)

    trainer = Overflowing(config(tmp_path, precision="fp16", max_nonfinite_steps=3), RunOptions(argv=[]),
                          log=lambda m: None)
    with pytest.raises(RepeatableFailure, match="for 3 steps in a row, since step 1: stopped at step 3"):
        trainer.run()
    assert trainer.scaler.get_scale() == 2.0**97
    assert trainer.state.skipped_steps == 3


@pytest.mark.slow
def test_under_the_launcher_a_nan_loss_is_not_restarted(tmp_path: Path) -> None:
    # a resume from the last good checkpoint repeats the same steps bit for bit: the launcher restarts nobody and
    # exits 1 with the worker's line (it restarted the workers 3 times, each failing at the same step)
    done = kubetrain("train", *EXPLODING, "--set", "train.max_nonfinite_steps=3", "--nproc", "2", "--max-restarts", "3",
                     cwd=tmp_path, check=False)
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stderr.count("failed (exitcode") == 1  # torch's agent saw one failure: no restart round
    assert done.stderr.splitlines()[-1].startswith(
        "error: the loss or its gradients were not finite (NaN or inf) for 3 steps in a row")
    assert "Traceback" not in done.stderr
    # one line for the job, the launcher's: not once per rank and again (the incident is beside it)
    assert sum("error: " in line for line in done.stderr.splitlines()) == 1, done.stderr[-3000:]
    assert_every_saved_tensor_is_finite(tmp_path / "runs" / "nan" / "checkpoints")

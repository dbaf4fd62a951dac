"""train.nonfinite: a step whose loss or gradients are not finite changes no weight and no optimizer state; a run whose
steps stay so stops with one line naming a checkpoint whose weights gave a finite loss; no checkpoint ever holds a
tensor that is not finite."""

from __future__ import annotations

import json
import math
import re
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
from kubetrain.errors import RepeatableFailure
from kubetrain.train.trainer import RunOptions, Trainer
from tests.conftest import RunMain
from tests.train.conftest import kubetrain, sets

# lr 1e30 (no warmup): the first update sends the weights to ~1e30, and the gradients of the next steps overflow
EXPLODING = sets("train.max_steps=20", "train.warmup_steps=0", "train.lr=1e30", "checkpoint.every_steps=1",
                 "eval.every_steps=5", "run.name=nan")
STOP_LINE = re.compile(
    r"error: the loss or its gradients were not finite \(NaN or inf\) for (\d+) steps in a row, since step (\d+): "
    r"stopped at step (\d+) \(those steps changed no weight\); the newest checkpoint whose weights gave a finite loss "
    r"is (\S+) \(resume from it with --resume (\S+), with a lower train\.lr, or check the data\)\n")
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
        trainer.guard.counted_at = (0, 0)
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
    assert match.group(4) == match.group(5) == str(ckpts / "step-000001")
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
    assert named == resume and int(Path(named).name.split("-")[1]) < int(first) - 1
    ckpts = tmp_cwd / "runs" / "nan" / "checkpoints"
    assert_every_saved_tensor_is_finite(ckpts)

    code, out, err = run_main("train", *args, "--set", f"train.max_steps={int(stopped) + 2}", "--resume", named)
    assert code == 0, err
    resumed_at = int(Path(named).name.split("-")[1])
    records = [json.loads(line) for line in (tmp_cwd / "runs" / "nan" / "metrics.jsonl").read_text().splitlines()]
    after = [r["loss"] for r in records if r["kind"] == "train" and r["step"] > resumed_at]
    assert len(after) == int(stopped) + 2 - resumed_at and all(math.isfinite(x) for x in after)
    assert_every_saved_tensor_is_finite(ckpts)


def test_a_run_that_ends_on_skipped_steps_fails_before_its_sample(run_main: RunMain, tmp_cwd: Path) -> None:
    code, out, err = run_main("train", *EXPLODING, "--set", "train.max_steps=4")  # below the default of 5 steps
    assert code == 1
    assert err.startswith("error: the loss or its gradients were not finite (NaN or inf) for ")
    assert "stopped at step 4" in err and "--- sample ---" not in out
    ckpts = tmp_cwd / "runs" / "nan" / "checkpoints"
    assert not (ckpts / "step-000004").exists()
    assert_every_saved_tensor_is_finite(ckpts)


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

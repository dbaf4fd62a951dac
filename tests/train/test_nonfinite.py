"""train.nonfinite: a run whose loss stays NaN/inf stops with one line naming the step and the last good checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kubetrain import checkpoint
from tests.conftest import RunMain
from tests.train.conftest import kubetrain, sets

# lr 1e30 (no warmup): step 2's update sends the weights to inf, and the loss is NaN from step 3 on
EXPLODING = sets("train.max_steps=20", "train.warmup_steps=0", "train.lr=1e30", "checkpoint.every_steps=1",
                 "eval.every_steps=5", "run.name=nan")


def test_a_loss_that_stays_nan_stops_the_run_naming_the_step_and_the_last_good_checkpoint(
    run_main: RunMain, tmp_cwd: Path
) -> None:
    code, out, err = run_main("train", *EXPLODING, "--set", "train.max_nonfinite_steps=3")
    run = tmp_cwd / "runs" / "nan"
    last_good = run / "checkpoints" / "step-000002"
    assert code == 1, err
    assert err == (f"error: the loss was not finite (NaN or inf) for 3 steps in a row, since step 3: stopped at step "
                   f"5; the last good checkpoint is {last_good.relative_to(tmp_cwd)} (a resume starts from it: lower "
                   f"train.lr, or check the data)\n")
    # nothing was evaluated or saved once the loss went bad: the newest checkpoint is the good one
    assert [p.name for p in checkpoint.complete_checkpoints(run / "checkpoints")] == ["step-000001", "step-000002"]
    assert json.loads((run / "meta.json").read_text())["status"] == "failed"
    assert "Traceback" not in out + err


def test_a_run_that_ends_on_a_nan_loss_fails_before_its_sample(run_main: RunMain, tmp_cwd: Path) -> None:
    code, _, err = run_main("train", *EXPLODING, "--set", "train.max_steps=4")  # below the default of 5 steps
    assert code == 1
    assert err.startswith("error: the loss was not finite (NaN or inf) for 2 steps in a row, since step 3: stopped "
                          "at step 4; the last good checkpoint is ")
    assert not (tmp_cwd / "runs" / "nan" / "checkpoints" / "step-000004").exists()


@pytest.mark.slow
def test_under_the_launcher_a_nan_loss_is_not_restarted(tmp_path: Path) -> None:
    # a resume from the last good checkpoint repeats the same steps bit for bit: the launcher restarts nobody and
    # exits 1 with the worker's line (it restarted the workers 3 times, each failing at the same step)
    done = kubetrain("train", *EXPLODING, "--set", "train.max_nonfinite_steps=3", "--nproc", "2", "--max-restarts", "3",
                     cwd=tmp_path, check=False)
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stderr.count("failed (exitcode") == 1  # torch's agent saw one failure: no restart round
    assert done.stderr.splitlines()[-1].startswith("error: the loss was not finite (NaN or inf) for 3 steps in a row")
    assert "Traceback" not in done.stderr

"""The loop through the real CLI: resume modes, refusal of foreign checkpoints, logged config changes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.train.conftest import kubetrain, sets

pytestmark = pytest.mark.slow


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

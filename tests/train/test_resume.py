"""Exact resume: a run killed at any moment (SIGKILL, also mid-checkpoint) or stopped with SIGTERM, then resumed,
ends with weights and a loss sequence bitwise identical to the same run never interrupted (CPU)."""

from __future__ import annotations

import contextlib
import json
import random
import signal
import time
from pathlib import Path

import pytest

from kubetrain.errors import EXIT_STOPPED_RESUMABLE
from tests.conftest import assert_same_weights
from tests.train.conftest import kubetrain, lines_in, sets, start, wait_until

pytestmark = pytest.mark.slow

STEPS = 40


def _args(name: str, cache: Path, *extra: str) -> list[str]:
    return ["train", *sets(
        f"run.name={name}", f"train.max_steps={STEPS}", "checkpoint.every_steps=3", "checkpoint.keep_last=2",
        "eval.every_steps=6", "train.log_every_steps=4", "model.n_embd=64", "model.n_layer=3",
        f"data.cache_dir={cache}", *extra,
    )]


def _losses(run: Path) -> list[tuple[str, int, float]]:
    out = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["kind"] == "train":
            out.append(("train", rec["step"], rec["loss"]))
        elif rec["kind"] == "eval":
            out.append(("eval", rec["step"], rec["val_loss"]))
    return out


def _final_weights(run: Path) -> Path:
    return run / "checkpoints" / f"step-{STEPS:06d}" / "model.safetensors"


def _assert_same_run(run: Path, reference: Path) -> None:
    assert _losses(run) == _losses(reference)
    assert_same_weights(_final_weights(run), _final_weights(reference))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    cwd = tmp_path_factory.mktemp("ref")
    cache = cwd / "cache"
    kubetrain(*_args("ref", cache), cwd=cwd)
    return cwd / "runs" / "ref", cache


def _last_step(run: Path) -> int:
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    steps = [0]
    for line in lines:
        with contextlib.suppress(ValueError, KeyError):  # a line being written
            steps.append(int(json.loads(line)["step"]))
    return max(steps)


def test_sigkill_at_random_moments_then_resume_is_bitwise_identical(
    reference: tuple[Path, Path], tmp_path: Path
) -> None:
    ref, cache = reference
    rng = random.Random(1234)
    run = tmp_path / "runs" / "killed"
    targets = sorted(rng.sample(range(2, STEPS - 2), 3))
    for target in targets:
        proc = start(*_args("killed", cache), cwd=tmp_path)
        wait_until(lambda t=target: _last_step(run) >= t, proc, poll=0.002)
        time.sleep(rng.uniform(0.0, 0.05))
        assert proc.poll() is None
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    kubetrain(*_args("killed", cache), cwd=tmp_path)
    _assert_same_run(run, ref)


def test_sigkill_in_the_middle_of_writing_a_checkpoint(reference: tuple[Path, Path], tmp_path: Path) -> None:
    ref, cache = reference
    run = tmp_path / "runs" / "torn"
    ckpts = run / "checkpoints"
    caught = False
    for _ in range(5):  # the window is a few milliseconds wide; poll for it
        proc = start(*_args("torn", cache), cwd=tmp_path)
        while proc.poll() is None:
            if ckpts.is_dir() and any(p.name.endswith(".tmp") for p in ckpts.iterdir()):
                proc.send_signal(signal.SIGKILL)
                proc.communicate()
                caught = any(p.name.endswith(".tmp") for p in ckpts.iterdir())
                break
        proc.communicate()
        if caught:
            break
    assert caught, "never caught a checkpoint mid-write"
    latest = (ckpts / "latest").read_text().strip() if (ckpts / "latest").exists() else None
    assert latest is None or (ckpts / latest / "meta.json").is_file()  # never a torn `latest`
    kubetrain(*_args("torn", cache), cwd=tmp_path)
    _assert_same_run(run, ref)


def test_sigterm_saves_a_checkpoint_and_exits_resumable(reference: tuple[Path, Path], tmp_path: Path) -> None:
    ref, cache = reference
    run = tmp_path / "runs" / "term"
    # checkpoints only at the end, so the one SIGTERM writes is the only way to keep the work
    proc = start(*_args("term", cache, "checkpoint.every_steps=1000", "eval.every_steps=1000"), cwd=tmp_path)
    metrics = run / "metrics.jsonl"
    wait_until(lambda: lines_in(metrics) >= 5, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_STOPPED_RESUMABLE, err
    assert "SIGTERM" in err and "Traceback" not in err
    stopped_at = json.loads((run / "meta.json").read_text())
    assert stopped_at["status"] == "stopped"
    step = int(stopped_at["step"])
    assert 5 <= step < STEPS
    assert (run / "checkpoints" / f"step-{step:06d}" / "meta.json").is_file()
    kubetrain(*_args("term", cache, "checkpoint.every_steps=1000", "eval.every_steps=1000"), cwd=tmp_path)
    # same weights as the reference (eval/checkpoint cadence does not touch the numerics)
    assert_same_weights(_final_weights(run), _final_weights(ref))
    train_losses = [x for x in _losses(run) if x[0] == "train"]
    assert train_losses == [x for x in _losses(ref) if x[0] == "train"]


def test_second_signal_exits_at_once_and_latest_stays_whole(reference: tuple[Path, Path], tmp_path: Path) -> None:
    _, cache = reference
    run = tmp_path / "runs" / "twice"
    proc = start(*_args("twice", cache), cwd=tmp_path)
    wait_until(lambda: _last_step(run) >= 6, proc, poll=0.002)
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode in (128 + signal.SIGTERM, EXIT_STOPPED_RESUMABLE), err
    latest = (run / "checkpoints" / "latest").read_text().strip()
    assert (run / "checkpoints" / latest / "meta.json").is_file()

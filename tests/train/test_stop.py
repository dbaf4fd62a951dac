"""Graceful stop when the grace period is shorter than the save: still resumable (75) from the newest complete one,
from a worker and from its launcher."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

from kubetrain import checkpoint
from kubetrain.errors import EXIT_STOPPED_RESUMABLE
from tests.train.conftest import kubetrain, sets, start, wait_until


@pytest.mark.slow
def test_sigterm_during_a_save_longer_than_the_grace_period_exits_resumable_and_names_the_step(
    tmp_path: Path,
) -> None:
    # a model whose checkpoint (about 40 MB with AdamW) takes far longer to write than 10 ms of grace
    args = ("run.name=late", "train.max_steps=400", "checkpoint.every_steps=3", "model.n_embd=256",
            "model.n_layer=4", "model.n_head=4", "checkpoint.grace_seconds=0.01", "eval.every_steps=1000")
    proc = start("train", *sets(*args), "--nproc", "2", cwd=tmp_path)  # the launcher's path too
    ckpts = tmp_path / "runs" / "late" / "checkpoints"
    wait_until((ckpts / "latest").exists, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_STOPPED_RESUMABLE, err[-2000:]
    named = re.search(r"the run resumes from (step-\d+) \(its newest complete checkpoint\)", err)  # a worker
    assert named, err[-2000:]
    assert f"launcher: SIGTERM: workers stopped before their stop checkpoint; the run resumes from {named.group(1)}" \
        in err
    step = checkpoint.verify(ckpts / named.group(1)).step  # complete and whole
    assert step >= 3 and checkpoint.pointer(ckpts, "latest") == named.group(1)
    resumed = kubetrain("train", *sets(*args, f"train.max_steps={step + 2}"), cwd=tmp_path)
    assert f"(step {step}," in resumed.stdout

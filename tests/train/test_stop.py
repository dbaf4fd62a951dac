"""Graceful stop: every rank stops at the same step, one step after any rank asked, through a CPU (gloo) vote;
when the grace period is shorter than the save, still resumable (75) from the newest complete checkpoint, from a
worker and from its launcher."""

from __future__ import annotations

import os
import re
import signal
import socket
from pathlib import Path

import pytest
import torch.distributed as td
import torch.multiprocessing as mp

from kubetrain import checkpoint
from kubetrain.errors import EXIT_STOPPED_RESUMABLE
from kubetrain.train.stop import StopVote
from tests.train.conftest import kubetrain, sets, start, wait_until


@pytest.mark.slow
@pytest.mark.ci  # a heavy end-to-end proof (many processes): .ci/run runs it, not the README's test command
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


def test_one_process_stops_at_once() -> None:
    vote = StopVote.for_world()
    assert vote.poll(False) is False and vote.poll(True) is True
    vote.close()


def _vote(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    td.init_process_group("gloo", rank=rank, world_size=world)
    try:
        vote = StopVote.for_world()
        # rank 1 is asked to stop during its third step (call index 2); nobody else is
        seen = [vote.poll(rank == 1 and step == 2) for step in range(5)]
        vote.close()
        Path(out, f"rank{rank}").write_text(",".join(str(int(s)) for s in seen))
    finally:
        td.destroy_process_group()


@pytest.mark.slow
def test_every_rank_stops_at_the_same_step_one_after_the_request(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_vote, args=(2, port, str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    # the request posted at call 2 is read at call 3 on both ranks (and the vote stays true while asked)
    assert (tmp_path / "rank0").read_text() == (tmp_path / "rank1").read_text() == "0,0,0,1,0"

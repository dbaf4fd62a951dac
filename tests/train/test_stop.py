"""StopVote: every rank stops at the same step, one step after any rank asked, through a CPU (gloo) vote."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch.distributed as td
import torch.multiprocessing as mp

from kubetrain.train.stop import StopVote


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

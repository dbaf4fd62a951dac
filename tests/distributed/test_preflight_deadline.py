"""The preflight's deadline: a rank SIGSTOPped inside the preflight is named by its peers through the rendezvous store,
and they end at the budget plus its margin instead of waiting in a collective for the group's start-up timeout
(dist.init_timeout_seconds, 1800 s by default)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kubetrain.distributed.preflight_deadline import margin
from kubetrain.errors import EXIT_PREFLIGHT
from tests.conftest import SRC, TINY, cli_env

# Started by the test only: rank 2 stops itself (SIGSTOP) as its send/recv sweep begins, inside the preflight.
STOP_RANK_2 = '''
import os
if os.environ.get("RANK") == "2" and os.environ.get("KT_TEST_STOP_IN_PREFLIGHT"):
    import signal
    import kubetrain.distributed.links as links
    sweep = links.link_sweep

    def stopped(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGSTOP)
        return sweep(*args, **kwargs)

    links.link_sweep = stopped
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.ci  # four processes, two minutes on the 2-core test machine: .ci/run runs it
@pytest.mark.slow
def test_a_rank_stopped_in_the_preflight_is_named_by_its_peers_which_end_at_the_deadline(tmp_path: Path) -> None:
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(STOP_RANK_2)
    world, budget, port = 4, 4.0, _free_port()
    procs = []
    for rank in range(world):
        env = cli_env(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), KT_TEST_STOP_IN_PREFLIGHT="1",
                      PYTHONPATH=os.pathsep.join([str(hook), str(SRC)]))
        sets = [*TINY, f"run.output_dir={tmp_path}", f"dist.preflight.budget_seconds={budget}",
                "dist.preflight.on_failure=stop"]  # the group's own timeout stays 1800 s
        command = [sys.executable, "-m", "kubetrain", "train", *(a for s in sets for a in ("--set", s))]
        procs.append(subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    try:
        # far below the 1800 s start-up timeout a stuck collective would otherwise wait for
        outputs = {r: procs[r].communicate(timeout=300) for r in (0, 1, 3)}
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)  # rank 2 is stopped: only SIGKILL ends it
                p.wait()
    codes = {r: procs[r].returncode for r in (0, 1, 3)}
    assert codes == {0: EXIT_PREFLIGHT, 1: EXIT_PREFLIGHT, 3: EXIT_PREFLIGHT}, (codes, outputs[0][1][-3000:])
    limit = budget + margin(budget)
    host = os.uname().nodename
    for r in (0, 1, 3):
        line = next(x for x in outputs[r][1].splitlines() if x.startswith("error: preflight:"))
        assert line.startswith(f"error: preflight: not finished within {limit:.0f} s"), line
        assert f"rank 2 (node {host}) does not answer (stopped, or its host is gone), last seen in its " in line, line
        assert "rank 0 (" not in line and "rank 1 (" not in line and "rank 3 (" not in line, line
        assert "model:" not in outputs[r][0] + outputs[r][1]  # ended before any model was built
    incidents = [json.loads(f.read_text()) for f in tmp_path.rglob("incidents/*.json")]
    assert [(i["kind"], i["rank"]) for i in incidents] == [("preflight", 2)]  # one rank speaks for the job

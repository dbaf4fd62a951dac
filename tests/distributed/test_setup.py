"""Two collective timeouts: the start-up one until the first step, `dist.timeout_seconds` after it (gloo)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import cli_env

# Rank 1 arrives late at the first collective (start-up: allowed), and late again after the switch (a hang).
WORKER = """
import json, os, sys, time
import torch, torch.distributed as td
from kubetrain.config.schema import DistConfig
from kubetrain.distributed import setup
cfg = DistConfig(backend="gloo", timeout_seconds=1, init_timeout_seconds=60)
setup.init(cfg, torch.device("cpu"))
rank = td.get_rank()
out = {"rank": rank}
if rank == 1:
    time.sleep(2.5)  # longer than timeout_seconds, within the start-up timeout
t = torch.ones(1)
td.all_reduce(t)
out["startup_all_reduce"] = float(t)
setup.use_step_timeout(cfg, torch.device("cpu"))
if rank == 1:
    time.sleep(4)
try:
    td.all_reduce(t)
    out["late_all_reduce"] = "ok"
except Exception as e:
    out["late_all_reduce"] = type(e).__name__ + ": " + str(e).splitlines()[0]
print(json.dumps(out), flush=True)
os._exit(0)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_the_short_timeout_applies_only_after_start_up(tmp_path: Path) -> None:
    port = _free_port()
    procs = [
        subprocess.Popen([sys.executable, "-c", WORKER], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=cli_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
        for r in range(2)
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    results = {}
    for out, err in outs:
        lines = [line for line in out.splitlines() if line.startswith("{")]
        assert lines, err[-3000:]
        row = json.loads(lines[-1])
        results[row["rank"]] = row
    assert results[0]["startup_all_reduce"] == 2.0  # waited 2.5 s for rank 1: the start-up timeout (60 s)
    assert "timed out" in results[0]["late_all_reduce"].lower(), results  # 1 s after the first step

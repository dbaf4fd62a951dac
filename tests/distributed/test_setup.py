"""Two collective timeouts: the start-up one until the first step, `dist.timeout_seconds` after it (gloo)."""

from __future__ import annotations

import ast
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

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


# Three ranks leave the group. "late": rank 0 arrives 2 s after the others, who must wait for it in teardown.
# "absent": rank 2 never calls teardown (it waits for the others' files instead); 0 and 1 must still get out,
# within the 2 s barrier bound, long before the group's own timeout (300 s).
TEARDOWN = """
import json, os, sys, time
from pathlib import Path
import torch, torch.distributed as td
from kubetrain.config.schema import DistConfig
from kubetrain.distributed import setup
scenario, root = sys.argv[1], Path(sys.argv[2])
setup.init(DistConfig(backend="gloo", timeout_seconds=300, init_timeout_seconds=300), torch.device("cpu"))
rank = td.get_rank()
t = torch.ones(1)
td.all_reduce(t)
out = {"rank": rank}
if scenario == "absent" and rank == 2:
    deadline = time.time() + 45
    while time.time() < deadline and not all((root / f"left-{r}").exists() for r in (0, 1)):
        time.sleep(0.1)
    out["others_left"] = all((root / f"left-{r}").exists() for r in (0, 1))
    print(json.dumps(out), flush=True)
    os._exit(0)
if scenario == "late" and rank == 0:
    time.sleep(2)
out["arrived"] = time.time()
setup.teardown(healthy=True, barrier_seconds=2 if scenario == "absent" else 60)
out["left"] = time.time()
(root / f"left-{rank}").write_text("")
print(json.dumps(out), flush=True)
"""


def _ranks(root: Path, scenario: str, world: int = 3) -> dict[int, dict[str, Any]]:
    """Run the three ranks of `scenario`; each must exit 0 without gloo's abort."""
    tmp_path = root / scenario
    tmp_path.mkdir()
    port = _free_port()
    procs = [
        subprocess.Popen([sys.executable, "-c", TEARDOWN, scenario, str(tmp_path)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         env=cli_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
        for r in range(world)
    ]
    results = {}
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0 and "terminate called" not in err, err[-3000:]
        row = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
        results[row["rank"]] = row
    return results


@pytest.mark.slow
def test_teardown_waits_for_a_late_peer_and_never_for_an_absent_one(tmp_path: Path) -> None:
    late = _ranks(tmp_path, "late")
    assert all(late[r]["left"] >= late[0]["arrived"] for r in (1, 2)), late
    absent = _ranks(tmp_path, "absent")
    assert absent[2]["others_left"] is True, absent  # out within the 2 s bound, the group's timeout is 300 s



# Loaded by every Python process of the run (PYTHONPATH): at exit, after kubetrain's teardown and before interpreter
# finalization, each rank writes which threads it still has.
AT_EXIT = """
import atexit, os
from pathlib import Path

def _threads():
    rank = os.environ.get("RANK")
    if rank is None:
        return  # the launcher, not a rank
    main = Path("/proc/self/comm").read_text().strip()
    task = Path("/proc/self/task")
    others = sorted(name for t in task.iterdir() if t.name != str(os.getpid())
                    for name in [(t / "comm").read_text().strip()])
    Path(os.environ["THREADS_AT_EXIT"], f"rank-{rank}").write_text(repr((main, others)))

atexit.register(_threads)
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads the threads of a process from /proc")
@pytest.mark.ci  # a heavy end-to-end proof (many processes): .ci/run runs it, not the README's test command
def test_an_fsdp_run_ends_with_its_gloo_backends_gone(tmp_path: Path) -> None:
    """destroy_process_group alone left each rank's gloo worker and TCP threads (and rank 0's TCPStore thread) to
    interpreter finalization, where gloo can abort the process (torch_compat.release_destroyed_groups); the
    background save of step 2 leaves no thread either (the shard saver's ends with the run)."""
    from tests.train.conftest import sets

    probe, seen = tmp_path / "probe", tmp_path / "seen"
    probe.mkdir()
    seen.mkdir()
    (probe / "sitecustomize.py").write_text(AT_EXIT)
    env = cli_env(THREADS_AT_EXIT=str(seen))
    env["PYTHONPATH"] = os.pathsep.join([str(probe), env["PYTHONPATH"]])
    done = subprocess.run([sys.executable, "-m", "kubetrain", "train",
                           *sets("dist.strategy=fsdp", "train.max_steps=3", "checkpoint.every_steps=2",
                                 "eval.every_steps=2"), "--nproc", "2"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "terminate called" not in done.stderr, done.stderr[-3000:]
    for rank in (0, 1):
        main, others = ast.literal_eval((seen / f"rank-{rank}").read_text())
        assert others == [], (rank, main, others)  # only the main thread is left

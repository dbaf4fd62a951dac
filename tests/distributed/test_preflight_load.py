"""A check that can stop a job must first never stop a healthy one: 20 healthy 4-process preflights on this machine,
with a CPU hog on every core beside them and `on_failure: stop`, stop none. The preflight alone
(tests/distributed/preflight_only.py) under torch.distributed.run, as `kubetrain train --nproc 4` starts it: 4 jobs
of 5 preflights each, since starting 4 processes that import torch costs this loaded 2-core machine about 2 minutes
a job, and a preflight seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kubetrain.runs.layout import PREFLIGHT_FILE
from tests.conftest import cli_env

JOBS, PREFLIGHTS = 4, 5
HOG = "while True:\n    pass\n"


@pytest.mark.ci  # twenty 4-process jobs on a loaded 2-core machine: minutes; .ci/run runs it
@pytest.mark.slow
def test_twenty_healthy_jobs_beside_a_cpu_hog_are_never_stopped(tmp_path: Path) -> None:
    helper = Path(__file__).with_name("preflight_only.py")
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(os.cpu_count() or 1)]
    stopped, seconds, second_looks = [], [], 0
    try:
        for job in range(JOBS):
            run_dir = tmp_path / f"job-{job}"
            proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                   "4", str(helper), str(run_dir), "stop", str(PREFLIGHTS)], env=cli_env(),
                                  capture_output=True, text=True, timeout=900)
            reports = [json.loads(p.read_text()) for p in sorted(run_dir.glob(f"*/{PREFLIGHT_FILE}"))]
            seconds += [r["seconds"] for r in reports]
            second_looks += sum(bool(r.get("second_look")) for r in reports)
            if proc.returncode != 0 or len(reports) != PREFLIGHTS:
                problems = [r["verdict"]["problems"] for r in reports if not r["verdict"]["ok"]]
                stopped.append((job, proc.returncode, problems, proc.stderr[-1500:]))
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert stopped == [], stopped
    print(f"{JOBS * PREFLIGHTS} preflights: seconds {seconds}, second looks {second_looks}")

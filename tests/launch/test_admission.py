"""The `--nproc` launcher admits only the workers this machine's cores and memory can hold, before starting any."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kubetrain.launch.admission import cores_problem, usable_cores
from kubetrain.selftest.resident import measure
from tests.conftest import cli_env


def test_more_processes_than_cores_is_refused_unless_oversubscribed() -> None:
    assert cores_problem(2, 2, oversubscribe=False) is None
    line = cores_problem(3, 2, oversubscribe=False)
    assert line is not None and "\n" not in line
    assert line.startswith("--nproc 3: more CPU processes than the 2 cores here") and "--oversubscribe" in line
    assert cores_problem(1000, 2, oversubscribe=True) is None


def test_a_cgroup_quota_lowers_the_cores(tmp_path: Path) -> None:
    affinity = len(os.sched_getaffinity(0))
    quota = tmp_path / "cpu.max"
    quota.write_text("150000 100000\n")  # 1.5 CPUs: a second process would still find a share of a core
    assert usable_cores(quota) == min(affinity, 2)
    quota.write_text("max 100000\n")
    assert usable_cores(quota) == affinity
    assert usable_cores(tmp_path / "absent") == affinity


def _refused_quickly(tmp_path: Path, *args: str) -> str:
    """Run `kubetrain ARGS`: it must exit 2 with one line, and no Python process but itself may have started."""
    started = time.monotonic()
    done = measure(list(args), timeout=120, env=cli_env(), cwd=tmp_path)
    assert time.monotonic() - started < 90  # a refusal, not 1000 workers starting (seen: 40 minutes of thrashing)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: --nproc") and "Traceback" not in done.stderr, errors
    assert len(done.per_process) == 1, done.per_process  # each Python process reports at exit: only the CLI did
    return errors[0]


@pytest.mark.parametrize("command", ["train", "doctor"])
def test_nproc_1000_on_the_cpu_returns_at_once_and_starts_no_worker(tmp_path: Path, command: str) -> None:
    extra = ["--dry-run"] if command == "train" else []
    line = _refused_quickly(tmp_path, command, "--preset", "tiny", "--set", "run.device=cpu", "--nproc", "1000",
                            *extra)
    assert "cores here" in line and "--oversubscribe" in line


def test_oversubscribed_1000_workers_are_refused_by_their_memory_before_any_starts(tmp_path: Path) -> None:
    # 1000 workers hold ~0.35 GiB each before their first tensor: no machine that runs this suite has 350 GiB free
    line = _refused_quickly(tmp_path, "train", "--preset", "tiny", "--set", "run.device=cpu", "--nproc", "1000",
                            "--oversubscribe", "--dry-run")
    assert "x1000 processes on this node" in line and "runtime" in line and "run fewer processes" in line


def test_doctor_with_oversubscribe_reports_the_node_s_need(tmp_path: Path) -> None:
    done = measure(["doctor", "--preset", "tiny", "--set", "run.device=cpu", "--nproc", "1000", "--oversubscribe"],
                   timeout=120, env=cli_env(), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "1000 processes on this node need" in done.stdout and "does NOT fit" in done.stdout

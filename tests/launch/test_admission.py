"""The `--nproc` launcher admits only the workers a node's cores and memory can hold, before starting any.

Every verdict here is made on a node the test states (2 cores, 24 GiB: the machine the refusal was written for),
never on the machine that runs the suite: on a host with 1000 cores and 350 GiB free, a test asking the host
would start 1000 workers. The end-to-end tests pin the CLI to one core, so it is refused whatever the host has."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kubetrain.config import Config, load_config
from kubetrain.errors import UserInputError
from kubetrain.launch.admission import Node, admit, cores_problem, refusal, usable_cores
from kubetrain.selftest.resident import measure
from kubetrain.train.launch_plan import LaunchPlan, plan_launch
from tests.conftest import cli_env

GIB = 2**30
SMALL_MACHINE = Node(cores=2, memory_free=24 * GIB)  # the 2-core, 24 GiB machine 1000 workers once took down


def tiny(*overrides: str) -> Config:
    return load_config(None, "tiny", ["run.device=cpu", *overrides])


def test_more_processes_than_cores_is_refused_unless_oversubscribed() -> None:
    assert cores_problem(2, 2, oversubscribe=False) is None
    line = cores_problem(3, 2, oversubscribe=False)
    assert line is not None and "\n" not in line
    assert line.startswith("--nproc 3: more CPU processes than the 2 cores here") and "--oversubscribe" in line
    assert cores_problem(1000, 2, oversubscribe=True) is None


def test_on_a_2_core_24_gib_node_the_decision_is_what_the_docs_say() -> None:
    # docs/performance.md: N is at most the usable cores (--oversubscribe allows more), and the node's processes,
    # with the launcher's runtime, fit in the memory free; both before any worker starts
    cfg = tiny()
    assert refusal(cfg, 2, "1", False, SMALL_MACHINE) is None  # one worker per core, a few GiB together
    cores = refusal(cfg, 3, "1", False, SMALL_MACHINE)
    assert cores is not None and cores.startswith("--nproc 3: more CPU processes than the 2 cores here")
    assert refusal(cfg, 4, "1", True, SMALL_MACHINE) is None  # oversubscribed: 4 x ~0.35 GiB fit in 24 GiB
    # 1000 oversubscribed workers hold ~0.35 GiB each before their first tensor: 350 GiB do not fit in 24
    memory = refusal(cfg, 1000, "1", True, SMALL_MACHINE)
    assert memory is not None and memory.startswith("--nproc 1000: this run needs about ")
    assert "x1000 processes on this node" in memory and "runtime" in memory and "run fewer processes" in memory
    assert "but 24.0 GiB is free on cpu" in memory and "\n" not in memory
    # the same 1000 on a node with 1 TiB free: the stated figure decides, not the host's
    assert refusal(cfg, 1000, "1", True, Node(cores=2, memory_free=1024 * GIB)) is None
    # a model two processes cannot hold in 24 GiB is refused even at one worker per core
    big = tiny("model.n_layer=8", "model.n_embd=4096", "model.n_head=32")
    assert (refusal(big, 2, "1", False, SMALL_MACHINE) or "").startswith("--nproc 2: this run needs about ")
    assert refusal(big, 2, "1", False, Node(cores=2, memory_free=None)) is None  # free memory unknown: silent
    assert refusal(tiny("run.check_memory=false"), 1000, "1", True, SMALL_MACHINE) is None  # the user's override


def test_admit_refuses_with_the_line_of_the_decision_on_the_node_given() -> None:
    def plan(nproc: int) -> LaunchPlan:
        return plan_launch(tiny(), nproc, 1, 1, free=SMALL_MACHINE.memory_free)

    with pytest.raises(UserInputError, match=r"^--nproc 3: more CPU processes than the 2 cores here"):
        admit(plan(3), cores=SMALL_MACHINE.cores)
    admit(plan(2), cores=SMALL_MACHINE.cores)


def test_a_cgroup_quota_lowers_the_cores(tmp_path: Path) -> None:
    affinity = len(os.sched_getaffinity(0))
    quota = tmp_path / "cpu.max"
    quota.write_text("150000 100000\n")  # 1.5 CPUs: a second process would still find a share of a core
    assert usable_cores(quota) == min(affinity, 2)
    quota.write_text("max 100000\n")
    assert usable_cores(quota) == affinity
    assert usable_cores(tmp_path / "absent") == affinity


@contextlib.contextmanager
def one_core() -> Iterator[None]:
    """This process and the commands it starts meanwhile may run on one core only: the node the CLI sees has 1."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _refused_quickly(tmp_path: Path, *args: str) -> str:
    """Run `kubetrain ARGS` on one core: it must exit 2 with one line, and no Python process but itself may have
    started."""
    started = time.monotonic()
    with one_core():
        done = measure(list(args), timeout=120, env=cli_env(), cwd=tmp_path)
    assert time.monotonic() - started < 90  # a refusal, not 1000 workers starting (seen: 40 minutes of thrashing)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: --nproc") and "Traceback" not in done.stderr, errors
    assert len(done.per_process) == 1, done.per_process  # each Python process reports at exit: only the CLI did
    return errors[0]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pins the CLI to one core")
@pytest.mark.parametrize("command", ["train", "doctor"])
def test_nproc_1000_on_one_core_returns_at_once_and_starts_no_worker(tmp_path: Path, command: str) -> None:
    extra = ["--dry-run"] if command == "train" else []
    line = _refused_quickly(tmp_path, command, "--preset", "tiny", "--set", "run.device=cpu", "--nproc", "1000",
                            *extra)
    assert "more CPU processes than the 1 cores here" in line and "--oversubscribe" in line


def test_doctor_with_oversubscribe_reports_the_node_s_need(tmp_path: Path) -> None:
    # doctor starts no worker: it reports what the node's processes need together (whether that fits is the
    # host's business, and the decision above is tested on a stated node)
    done = measure(["doctor", "--preset", "tiny", "--set", "run.device=cpu", "--nproc", "1000", "--oversubscribe"],
                   timeout=120, env=cli_env(), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "1000 processes on this node need" in done.stdout
    assert len(done.per_process) == 1, done.per_process

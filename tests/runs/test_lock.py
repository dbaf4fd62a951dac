"""One live run per run directory: the lock's rules (unit), then two real runs on one directory, and the elastic
agent's restart of rank 0 under the launcher's lock and under a rank 0 lock (the pods' way)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from kubetrain.errors import EXIT_BAD_INPUT, EXIT_STOPPED_RESUMABLE, UserInputError
from kubetrain.runs.lock import JOB_ENV, LOCK_FILE, STALE_AFTER_SECONDS, Holder, hold, read_holder, this_process
from tests.train.conftest import children, kubetrain, sets, start, wait_until


def _write(run: Path, holder: Holder) -> Path:
    run.mkdir(parents=True, exist_ok=True)
    (run / LOCK_FILE).write_text(json.dumps(asdict(holder)))
    return run / LOCK_FILE


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_live_run_holds_the_directory_and_a_second_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "r"
    said: list[str] = []
    with hold(run, None, said.append) as first:
        held = read_holder(run / LOCK_FILE)
        assert held == first.holder and held.host == socket.gethostname() and held.pid == os.getpid()
        with pytest.raises(UserInputError, match=rf"in use by another run \(pid {os.getpid()} on ") as refused:
            hold(run, None, said.append)
        assert "\n" not in str(refused.value)
        with pytest.raises(UserInputError):  # another job is refused the same way
            hold(run, "some-other-job", said.append)
    assert not (run / LOCK_FILE).exists() and said == []
    assert not (tmp_path / "runs").exists()  # held and left without writing anything: no empty folders


def test_a_stale_lock_of_a_dead_process_is_taken_over_and_said_so(tmp_path: Path) -> None:
    run = tmp_path / "r"
    _write(run, Holder(socket.gethostname(), _dead_pid(), None, time.time() - 5))
    said: list[str] = []
    with hold(run, None, said.append) as lock:
        assert read_holder(run / LOCK_FILE) == lock.holder
    assert len(said) == 1 and said[0].startswith("note: taking over the run lock of a run that is gone (pid ")


def test_a_reused_pid_is_not_the_holder(tmp_path: Path) -> None:
    run = tmp_path / "r"
    me = this_process(None)
    if me.started is None:
        pytest.skip("no /proc: a process's start time cannot be read here")
    _write(run, Holder(me.host, me.pid, None, time.time(), started=me.started - 1))  # our PID, another process
    said: list[str] = []
    with hold(run, None, said.append):
        assert said and "gone" in said[0]


def test_a_lock_on_another_host_is_live_until_it_goes_unrefreshed(tmp_path: Path) -> None:
    run = tmp_path / "r"
    lock = _write(run, Holder("elsewhere", 1, "their-job", time.time()))
    with pytest.raises(UserInputError, match="pid 1 on elsewhere"):
        hold(run, None, print)
    old = time.time() - STALE_AFTER_SECONDS - 1
    os.utime(lock, (old, old))
    said: list[str] = []
    with hold(run, None, said.append):
        assert said and "gone" in said[0]


def test_a_restarted_worker_of_the_same_job_takes_over_from_its_predecessor_on_any_host(tmp_path: Path) -> None:
    run = tmp_path / "r"
    _write(run, Holder("the-pod-that-died", 7, "job-1", time.time()))  # fresh: a lock of another job would hold
    said: list[str] = []
    with hold(run, "job-1", said.append) as lock:
        assert lock.owned and read_holder(run / LOCK_FILE) == lock.holder
    assert said and "this job's previous process" in said[0]


def test_workers_share_the_lock_their_launcher_holds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "r"
    launcher = this_process("launcher-abc")  # this process plays the launcher: alive, on this host
    _write(run, launcher)
    monkeypatch.setenv(JOB_ENV, "launcher-abc")
    with hold(run, "launcher-abc", print) as worker:
        assert not worker.owned
    assert read_holder(run / LOCK_FILE) == launcher  # a worker's exit leaves the launcher's lock in place


def test_release_leaves_a_lock_that_another_run_took_over(tmp_path: Path) -> None:
    run = tmp_path / "r"
    lock = hold(run, None, print)
    other = _write(run, Holder(socket.gethostname(), 1, "job-2", time.time()))
    lock.release()
    assert other.exists()


# --- real runs ------------------------------------------------------------------------------------------------

LONG = ("train.max_steps=100000", "eval.every_steps=1000", "checkpoint.every_steps=1000")


@pytest.mark.slow
def test_a_second_run_on_a_live_run_directory_is_refused_in_one_line(tmp_path: Path) -> None:
    first = start("train", *sets("run.name=busy", *LONG), cwd=tmp_path)
    metrics = tmp_path / "runs" / "busy" / "metrics.jsonl"
    wait_until(metrics.exists, first)
    for extra in ([], ["--nproc", "2"]):  # the launcher refuses before it starts any worker
        second = kubetrain("train", *sets("run.name=busy", *LONG), *extra, cwd=tmp_path, check=False)
        assert second.returncode == EXIT_BAD_INPUT, second.stderr
        assert second.stderr.startswith("error: runs/busy is in use by another run (pid ")
        assert second.stderr.count("\n") == 1
    first.send_signal(signal.SIGTERM)
    _, err = first.communicate(timeout=120)
    assert first.returncode == EXIT_STOPPED_RESUMABLE, err
    assert not (tmp_path / "runs" / "busy" / LOCK_FILE).exists()


def _rank0_worker(launcher: int) -> int | None:
    """The pid of the worker with RANK=0 among the launcher's descendants (torchrun starts them in sessions)."""
    todo = list(children(launcher))
    while todo:
        pid = todo.pop()
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"RANK=0" in env and b"TORCHELASTIC_RUN_ID" in b" ".join(env):
            return pid
        todo += children(pid)
    return None


@pytest.mark.slow
@pytest.mark.parametrize("how", ["launcher", "rank0"])
@pytest.mark.ci  # a heavy end-to-end proof (many processes): .ci/run runs it, not the README's test command
def test_the_elastic_agent_restarts_rank_0_under_the_lock(tmp_path: Path, how: str) -> None:
    # "launcher": `--nproc` on one node, whose launcher holds the lock; "rank0": a rendezvous endpoint, as pods
    # use, where global rank 0 holds it and its restarted successor takes it over from the killed one.
    common = sets("run.name=restart", "train.max_steps=20", "checkpoint.every_steps=5", "eval.every_steps=100",
                  "checkpoint.keep_last=1")
    extra = [] if how == "launcher" else ["--rdzv-endpoint", f"127.0.0.1:{_free_port()}"]
    proc = start("train", *common, "--nproc", "2", *extra, cwd=tmp_path)  # restarts by default
    wait_until((tmp_path / "runs" / "restart" / "checkpoints" / "latest").exists, proc)
    rank0 = _rank0_worker(proc.pid)
    assert rank0 is not None
    holder = read_holder(tmp_path / "runs" / "restart" / LOCK_FILE)
    assert holder is not None and holder.pid == (proc.pid if how == "launcher" else rank0)
    os.kill(rank0, signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "resuming from" in out
    if how == "rank0":
        assert "taking over the run lock of this job's previous process" in out
    assert json.loads((tmp_path / "runs" / "restart" / "meta.json").read_text())["step"] == 20
    assert not (tmp_path / "runs" / "restart" / LOCK_FILE).exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

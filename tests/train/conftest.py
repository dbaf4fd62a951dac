"""Fixtures for training tests: a tiny config as --set overrides, and a way to run the real CLI."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import cli_env

TINY = [
    "run.threads=1",
    "model.n_layer=2",
    "model.n_head=2",
    "model.n_embd=32",
    "model.block_size=32",
    "train.micro_batch_size=4",
    "train.warmup_steps=2",
    "train.log_every_steps=1",
    "eval.windows=2",
    "eval.sample_tokens=8",
]


def sets(*items: str) -> list[str]:
    out: list[str] = []
    for item in (*TINY, *items):
        out += ["--set", item]
    return out


def kubetrain(*args: str, cwd: Path, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "kubetrain", *args], cwd=cwd, env=cli_env(), capture_output=True, text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"kubetrain {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


STARTED: list[subprocess.Popen[str]] = []


def start(*args: str, cwd: Path) -> subprocess.Popen[str]:
    """A `kubetrain` process in the background; whatever is left of it is killed when the test ends."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kubetrain", *args], cwd=cwd, env=cli_env(), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )
    STARTED.append(proc)
    return proc


def wait_until(ready: Callable[[], bool], proc: subprocess.Popen[str], poll: float = 0.01) -> None:
    """Poll `ready` while `proc` runs; a process that ends first fails the test with its output.

    No deadline of its own: pytest-timeout bounds the test, and the processes die with it.
    """
    while not ready():
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"process ended ({proc.returncode}) before the condition held:\n{out}\n{err}")
        time.sleep(poll)


def lines_in(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def children(pid: int) -> list[int]:
    """The pids of a process's children (read from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def rank_of(pid: int) -> int | None:
    """The global rank torch's agent gave a worker (its RANK variable); None for a child that is no worker (or one
    gone meanwhile)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((int(v.split(b"=", 1)[1]) for v in env if v.startswith(b"RANK=")), None)


def kill_tree(pid: int) -> None:
    """Kill a process and all its descendants (torchrun starts workers in sessions of their own)."""
    for child in children(pid):
        kill_tree(child)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


@pytest.fixture(autouse=True)
def _no_leftover_processes() -> Iterator[None]:
    yield
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:
            kill_tree(proc.pid)
            proc.communicate()


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path

"""kubetrain.locks: flock where the file system has it, a lock file naming its holder where it does not.

No file system without flock can be mounted here (Lustre's noflock, a FUSE mount), so the fallback is reached by
making fcntl.flock answer what such a file system answers (OSError ENOLCK), in this process and in the two
contending processes below; everything else (the lock files, the processes, the kernel's flock) is real.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kubetrain import locks
from kubetrain.checkpoint import verdict
from kubetrain.data.fingerprints import DigestCache, file_digest
from tests.conftest import cli_env

fcntl = pytest.importorskip("fcntl")


def _no_flock(monkeypatch: pytest.MonkeyPatch, code: int = errno.ENOLCK) -> None:
    def refuse(fd: int, operation: int) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(fcntl, "flock", refuse)


def test_with_flock_no_lock_file_is_left(tmp_path: Path) -> None:
    with locks.exclusive(tmp_path / "x.lock"):
        assert not (tmp_path / "x.lock.held").exists()


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS])
def test_without_flock_a_lock_file_names_the_holder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    code: int) -> None:
    _no_flock(monkeypatch, code)
    with locks.exclusive(tmp_path / "x.lock"):
        held = json.loads((tmp_path / "x.lock.held").read_text())
        assert (held["host"], held["pid"]) == (socket.gethostname(), os.getpid())
    assert not (tmp_path / "x.lock.held").exists()


def test_another_flock_error_is_not_hidden(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _no_flock(monkeypatch, errno.EIO)
    with pytest.raises(OSError, match="Input/output error"), locks.exclusive(tmp_path / "x.lock"):
        pass


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_the_lock_file_of_a_holder_that_is_gone_is_broken(tmp_path: Path) -> None:
    lock = tmp_path / "x.lock.held"
    assert locks.create_lock_file(lock, locks.Holder(socket.gethostname(), _dead_pid(), None, time.time()))
    with locks.hold_lock_file(lock) as me:  # a dead PID on this host
        assert locks.read_holder(lock) == me
    assert locks.create_lock_file(lock, locks.Holder("another-node", 1, None, time.time()))
    old = time.time() - locks.STALE_AFTER_SECONDS - 10
    os.utime(lock, (old, old))
    with locks.hold_lock_file(lock) as me:  # another host's, not refreshed for longer than STALE_AFTER_SECONDS
        assert locks.read_holder(lock) == me


def test_a_live_holder_on_another_host_is_waited_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lock = tmp_path / "x.lock.held"
    assert locks.create_lock_file(lock, locks.Holder("another-node", 1, None, time.time()))
    looked, taken = threading.Event(), threading.Event()
    real_sleep = time.sleep

    def waiter() -> None:
        with locks.hold_lock_file(lock):
            taken.set()

    def sleep(seconds: float) -> None:  # the waiter's poll: proof that it looked at the lock and waited
        looked.set()
        real_sleep(seconds)

    monkeypatch.setattr(locks.time, "sleep", sleep)
    thread = threading.Thread(target=waiter)
    thread.start()
    assert looked.wait(60)
    assert not taken.is_set()  # fresh: its holder on the other node is alive
    lock.unlink()  # the other node's process ends
    thread.join(60)
    assert taken.is_set() and not lock.exists()


# Each process adds 1 to a counter file ROUNDS times inside the lock, reading, yielding, then writing: without
# mutual exclusion the two interleave and updates are lost.
CONTENDER = """
import errno, fcntl, os, sys, time
from pathlib import Path
from kubetrain import locks

def refuse(fd, operation):
    raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))  # what Lustre mounted noflock answers

if sys.argv[2] == "fallback":
    fcntl.flock = refuse
folder = Path(sys.argv[1])
(folder / f"ready-{os.getpid()}").touch()
while len(list(folder.glob("ready-*"))) < 2:  # both start contending together
    time.sleep(0.01)
for _ in range(int(sys.argv[3])):
    with locks.exclusive(folder / "count.lock"):
        n = int((folder / "count").read_text())
        time.sleep(0.002)
        (folder / "count").write_text(str(n + 1))
"""


@pytest.mark.parametrize("kind", ["flock", "fallback"])
def test_two_processes_contending_for_the_lock_never_overlap(tmp_path: Path, kind: str) -> None:
    rounds = 40
    (tmp_path / "count").write_text("0")
    procs = [subprocess.Popen([sys.executable, "-c", CONTENDER, str(tmp_path), kind, str(rounds)], env=cli_env())
             for _ in range(2)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    assert int((tmp_path / "count").read_text()) == 2 * rounds
    assert not (tmp_path / "count.lock.held").exists()


def test_resume_s_verification_and_prepare_s_digests_work_without_flock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_flock(monkeypatch)
    step = tmp_path / "checkpoints" / "step-000002"
    step.mkdir(parents=True)
    with verdict.exclusive(step):  # was: OSError ENOLCK out of fcntl.flock, and the resume failed
        assert list((tmp_path / "checkpoints").rglob("*.lock.held"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("In the beginning")
    cache = DigestCache(tmp_path / "cache")
    assert cache.digests([corpus]) == [file_digest(corpus)]  # was: OSError ENOLCK, and prepare failed

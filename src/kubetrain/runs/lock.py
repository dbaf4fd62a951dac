"""One live run per run directory: a lock file that names the holder's host, PID and job.

Two runs writing one directory both fail later (each renames checkpoints the other expects), so the second
is refused at the start. Only one process of a job holds the lock: the launcher of `train --nproc` (its
workers share it), else global rank 0. A worker restarted by the elastic agent belongs to the same job (the
same launcher token, or torchrun's TORCHELASTIC_RUN_ID, which is the rendezvous id) and takes the lock over
from its dead predecessor, on whichever node it now runs. A lock whose holder is gone is taken over and said
so: on this host when its PID is dead, on another host when it was not refreshed for STALE_AFTER_SECONDS.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from kubetrain.errors import UserInputError
from kubetrain.locks import (
    REFRESH_SECONDS,
    STALE_AFTER_SECONDS,
    Holder,
    create_lock_file,
    holder_alive,
    read_holder,
    this_process,
)

LOCK_FILE = "run.lock"
JOB_ENV = "KUBETRAIN_RUN_JOB"  # set by the launcher for its workers: they run under its lock
__all__ = ["JOB_ENV", "LOCK_FILE", "STALE_AFTER_SECONDS", "Holder", "RunLock", "hold", "hold_for_workers",
           "read_holder", "this_process"]

Say = Callable[[str], None]


def job_identity() -> str | None:
    """This process's job: the launcher's token, else torchrun's run id (the rendezvous id); None when alone."""
    return os.environ.get(JOB_ENV) or os.environ.get("TORCHELASTIC_RUN_ID") or None


class RunLock:
    """A held (or, for a launcher's worker, shared) run directory lock; `release` removes it if it is ours."""

    def __init__(self, path: Path, holder: Holder, owned: bool, created: Path | None) -> None:
        self.path, self.holder, self.owned, self.created = path, holder, owned, created
        self.lock = path / LOCK_FILE
        self._stop = threading.Event()
        if owned:  # refreshed, so that a host that cannot check our PID sees the run is alive
            threading.Thread(target=self._refresh, name="run-lock", daemon=True).start()

    def _refresh(self) -> None:
        while not self._stop.wait(REFRESH_SECONDS):
            with contextlib.suppress(OSError):
                os.utime(self.lock)

    def release(self) -> None:
        self._stop.set()
        if not self.owned:
            return
        if self.holder.job is not None and os.environ.get(JOB_ENV) == self.holder.job:
            del os.environ[JOB_ENV]
        if read_holder(self.lock) == self.holder:  # never remove the lock of a run that took ours over
            with contextlib.suppress(OSError):
                self.lock.unlink()
        if self.created is not None:  # a run refused before it wrote anything leaves no empty folders behind
            folder = self.path
            with contextlib.suppress(OSError):  # not empty: the run wrote something, keep it
                while True:
                    folder.rmdir()
                    if folder == self.created:
                        break
                    folder = folder.parent

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.release()


def hold(path: Path, job: str | None, say: Say) -> RunLock:
    """Hold `path` for this run, or raise UserInputError naming the live run that holds it."""
    created = _first_missing(path)
    path.mkdir(parents=True, exist_ok=True)
    lock, me = path / LOCK_FILE, this_process(job)
    for _ in range(3):  # a lock that appears or goes while we look: look again
        if create_lock_file(lock, me):
            return RunLock(path, me, owned=True, created=created)
        held = read_holder(lock)
        if held is None:
            with contextlib.suppress(OSError):
                if lock.stat().st_size == 0 or time.time() - lock.stat().st_mtime > STALE_AFTER_SECONDS:
                    lock.unlink()  # torn by a kill between create and write
            continue
        if held.job is not None and held.job == job:
            if held.alive_here():  # our launcher holds it for its workers
                return RunLock(path, held, owned=False, created=None)
            say(f"note: taking over the run lock of this job's previous process ({held.describe()}); "
                f"the elastic agent restarted it")
        elif holder_alive(lock, held):
            raise UserInputError(
                f"{path} is in use by another run ({held.describe()}); wait for it to end or stop it, "
                f"or choose another run.name")
        else:
            say(f"note: taking over the run lock of a run that is gone ({held.describe()})")
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()
    raise UserInputError(f"{path}: could not take the run lock {lock}: other runs keep taking it")


def _first_missing(path: Path) -> Path | None:
    """The outermost folder of `path` that does not exist yet (what mkdir(parents=True) creates), or None."""
    missing = None
    for folder in (path, *path.parents):
        if folder.exists():
            break
        missing = folder
    return missing


def hold_for_workers(path: Path, say: Say) -> RunLock:
    """The launcher holds `path` for the whole job (restarts included) and hands its token to its workers."""
    token = f"launcher-{uuid.uuid4().hex}"
    held = hold(path, token, say)
    os.environ[JOB_ENV] = token  # the workers inherit it: they run under this lock
    return held

"""Work shared by processes through a folder: claim a task with a file, keep it alive, wait for the others.

Ranks, pods and `prepare --nproc` workers need no collective and no rank numbers to split the preparation of a
dataset: each claims the next unclaimed task by creating its claim file (O_EXCL: one winner, also on NFS),
touches the file while it works (a heartbeat thread), and writes the task's result under a temporary name that
is renamed into place. A claim whose file has not been touched for STALE_SECONDS belongs to a process that
died: another takes it over. Results are deterministic and renamed atomically, so the worst a race can cost
is a task done twice. Waiting for the others is polling the folder, with progress in the log.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kubetrain.errors import DataError

STALE_SECONDS = 60.0
HEARTBEAT_SECONDS = 5.0
PROGRESS_SECONDS = 15.0
ERROR_SUFFIX = ".error"

Log = Callable[[str], None]


def process_tag() -> str:
    """This process among all that share the folder (pods share pids): for temporary file names."""
    return f"{socket.gethostname()}-{os.getpid()}"


class Claims:
    """The claim files of one piece of shared work, in `folder`."""

    def __init__(self, folder: Path, stale_seconds: float = STALE_SECONDS) -> None:
        self.folder = folder
        self.stale_seconds = stale_seconds
        self.owner = f"{socket.gethostname()}:{os.getpid()}"
        self.started = time.time() - 1.0  # file times have coarse ticks on some file systems
        self._held: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        folder.mkdir(parents=True, exist_ok=True)

    def _path(self, task: str) -> Path:
        return self.folder / task  # task names are plain file names

    def claim(self, task: str) -> bool:
        """True when this process now owns the task: it was free, or its owner stopped beating."""
        path = self._path(task)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileNotFoundError:  # the folder is gone: the work was finished and moved into place
            return False
        except FileExistsError:
            if not self.is_stale(task):
                return False
            tmp = path.with_name(f".{path.name}.{process_tag()}")
            try:
                tmp.write_text(self.owner)
                os.replace(tmp, path)  # taken over; a second taker at the same moment only duplicates the work
            except FileNotFoundError:  # the folder is gone: the work was finished and moved into place
                return False
        else:
            with os.fdopen(fd, "w") as f:
                f.write(self.owner)
        self._path(task).with_name(path.name + ERROR_SUFFIX).unlink(missing_ok=True)
        with self._lock:
            self._held.add(task)
        self._start_beating()
        return True

    def is_stale(self, task: str) -> bool:
        try:
            return time.time() - self._path(task).stat().st_mtime > self.stale_seconds
        except FileNotFoundError:
            return True

    def is_claimed(self, task: str) -> bool:
        return self._path(task).exists()

    def release(self, task: str) -> None:
        with self._lock:
            self._held.discard(task)
        self._path(task).unlink(missing_ok=True)

    def fail(self, task: str, message: str) -> None:
        """Record why the task cannot be done, so the processes waiting for it stop with the same error."""
        self._path(task).with_name(self._path(task).name + ERROR_SUFFIX).write_text(message)

    def failures(self) -> dict[str, str]:
        """Why tasks failed, as recorded since this process started (older records are retried, not trusted:
        the cause, a missing package say, may be gone)."""
        found: dict[str, str] = {}
        if not self.folder.is_dir():
            return found
        for entry in os.scandir(self.folder):
            if entry.name.endswith(ERROR_SUFFIX) and entry.stat().st_mtime >= self.started:
                with contextlib.suppress(FileNotFoundError):
                    found[entry.name[: -len(ERROR_SUFFIX)]] = Path(entry.path).read_text()
        return found

    def close(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        with self._lock:
            held, self._held = set(self._held), set()
        for task in held:
            self._path(task).unlink(missing_ok=True)

    def _start_beating(self) -> None:
        if self._beat is None:
            self._beat = threading.Thread(target=self._beating, name="kubetrain-claims", daemon=True)
            self._beat.start()

    def _beating(self) -> None:
        while not self._stop.wait(min(HEARTBEAT_SECONDS, self.stale_seconds / 4)):
            with self._lock:
                held = list(self._held)
            for task in held:
                with contextlib.suppress(FileNotFoundError):
                    os.utime(self._path(task))


def share(
    tasks: Sequence[str], finished: Callable[[], set[str]], is_done: Callable[[str], bool],
    do: Callable[[str], None], claims: Claims, log: Log | None = None, what: str = "tasks", first: int = 0,
) -> None:
    """Do every task that no live process is doing, then wait until all are done (by anyone).

    `finished` lists the done tasks in one look at the folder (polled); `is_done` checks one (after a claim,
    in case another process finished it just before). `first` rotates where this process starts looking, so
    processes that start together rarely race. A task that failed in another process raises its error here.
    """
    k = first % len(tasks) if tasks else 0
    order = list(tasks[k:]) + list(tasks[:k])
    last_note = time.monotonic()
    pause = 0.05
    while True:
        done = finished()
        pending = [t for t in order if t not in done]
        if not pending:
            return
        failed = claims.failures()
        for task in pending:
            if task in failed:
                raise DataError(failed[task])
        worked = False
        for task in pending:
            if not claims.claim(task):
                continue
            try:
                if not is_done(task):
                    do(task)
            except DataError as e:
                claims.fail(task, str(e))
                raise
            finally:
                claims.release(task)
            worked = True
            break  # look at the folder again: others may have finished what comes next
        if worked:
            pause = 0.05
            continue
        if log and time.monotonic() - last_note >= PROGRESS_SECONDS:
            log(f"waiting for other processes: {len(order) - len(pending)}/{len(order)} {what} done, "
                f"{len(pending)} in progress")
            last_note = time.monotonic()
        time.sleep(pause)
        pause = min(2.0, pause * 2)

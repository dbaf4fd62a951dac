"""Locks between processes on a file: `flock` where the file system has it, else a lock file that names its holder.

flock is the lock to have: the kernel (or the network file system's lock manager) drops it when its holder dies.
Some file systems refuse it: Lustre mounted `noflock` answers ENOLCK, others EOPNOTSUPP or ENOSYS. There the
same lock is a lock file created exclusively (a hard link of a whole file, else O_CREAT|O_EXCL: atomic on POSIX
file systems, NFSv3 and later too) that names its holder (host, PID, the process's start time, since when). The
holder refreshes its mtime while it holds it; a waiter removes it when its holder is gone: a dead PID (or a PID
reused by a later process) on this host, no refresh for STALE_AFTER_SECONDS on another (filelock's SoftFileLock
with stale detection, written here so that its behaviour does not change with the filelock a user's torch pins).

A leaf module (standard library only): data/, checkpoint/ and runs/ all take locks.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

REFRESH_SECONDS = 30.0
STALE_AFTER_SECONDS = 120.0  # a lock file on another host not refreshed for this long belongs to a dead process
POLL_SECONDS = 0.05
# what flock answers on a file system without it: Lustre -o noflock (ENOLCK), FUSE and others
FLOCK_UNSUPPORTED = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS})


@dataclass(frozen=True)
class Holder:
    """Who holds a lock file: enough to tell a live holder from a dead one and a restart from a stranger."""

    host: str
    pid: int
    job: str | None
    since: float
    started: int | None = None  # the process's start time in clock ticks since boot: a reused PID differs

    def alive_here(self) -> bool:
        """This host's process `pid` is running and is the same process (not a later one given the same PID)."""
        if self.host != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # it exists, owned by another user
        return self.started is None or process_start(self.pid) in (None, self.started)

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.since))}"


def process_start(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, from /proc), or None where /proc has no answer."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22 of proc(5), counted after the command name


def this_process(job: str | None = None) -> Holder:
    return Holder(socket.gethostname(), os.getpid(), job, time.time(), process_start(os.getpid()))


def read_holder(lock: Path) -> Holder | None:
    """The holder a lock file names; None when there is none (or an unreadable one: a torn write holds nothing)."""
    try:
        data = json.loads(lock.read_text())
        return Holder(str(data["host"]), int(data["pid"]), data.get("job"), float(data["since"]), data.get("started"))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def holder_alive(lock: Path, held: Holder) -> bool:
    """Whether the lock's holder still runs: its PID on this host, the lock file's freshness on another."""
    if held.host == socket.gethostname():
        return held.alive_here()
    try:
        return time.time() - lock.stat().st_mtime < STALE_AFTER_SECONDS
    except FileNotFoundError:
        return False


def create_lock_file(lock: Path, me: Holder) -> bool:
    """Write the lock whole, then link it into place: readers never see half of one; False if one exists."""
    text = json.dumps(asdict(me))
    tmp = lock.with_name(f".{lock.name}.{me.pid}.{uuid.uuid4().hex[:8]}")
    tmp.write_text(text)
    try:
        os.link(tmp, lock)
        return True
    except FileExistsError:
        return False
    except OSError:  # a filesystem without hard links: exclusive create, then write
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        return True
    finally:
        tmp.unlink()


@contextlib.contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """Hold the lock named `path` until the block ends, waiting for its holder: flock on `path`, or where the
    file system has no flock, the lock file `path`.held (`hold_lock_file`). OSError when `path` cannot be
    created (a read-only folder): the caller decides whether to go on without a lock."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if _flock(fd):
            yield  # closing the descriptor below releases it
            return
    finally:
        os.close(fd)
    with hold_lock_file(path.with_name(path.name + ".held")):
        yield


def _flock(fd: int) -> bool:
    """Take flock on `fd`, waiting for it; False where this file system (or platform) has no flock."""
    try:
        import fcntl
    except ImportError:  # Windows
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError as e:
        if e.errno in FLOCK_UNSUPPORTED:
            return False
        raise
    return True


@contextlib.contextmanager
def hold_lock_file(lock: Path) -> Iterator[Holder]:
    """Create `lock` naming this process (waiting while a live holder has it), refresh it while the block runs,
    remove it after. A holder that is gone loses it: a waiter removes its file, then creates its own."""
    me = this_process()
    while not create_lock_file(lock, me):
        held = read_holder(lock)
        if held is None:  # gone between our create and our read, or torn by a kill before its write
            with contextlib.suppress(OSError):
                if time.time() - lock.stat().st_mtime > STALE_AFTER_SECONDS:
                    lock.unlink()
        elif not holder_alive(lock, held) and read_holder(lock) == held:  # still that dead holder's: break it
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()
            continue
        time.sleep(POLL_SECONDS)
    stop = threading.Event()
    refresher = threading.Thread(target=_refresh, args=(lock, stop), name="lock-refresh", daemon=True)
    refresher.start()
    try:
        yield me
    finally:
        stop.set()
        if read_holder(lock) == me:  # never remove a lock that a waiter broke and took (we looked dead to it)
            with contextlib.suppress(OSError):
                lock.unlink()


def _refresh(lock: Path, stop: threading.Event) -> None:
    while not stop.wait(REFRESH_SECONDS):
        with contextlib.suppress(OSError):
            os.utime(lock)

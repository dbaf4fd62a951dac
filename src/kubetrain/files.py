"""Writing files so that a kill or a full disk never leaves a torn one: atomic replace, fsync.

A leaf module: run files (runs/) and checkpoints (checkpoint/) both need it, and runs/ reads checkpoints,
so it cannot live in either without the two importing each other.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path


def write_atomic(path: Path, text: str) -> None:
    """Write a small file so that readers see the old or the new content, never half of it."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems do not fsync directories
        fsync_file(path)


def umask() -> int:
    """This process's umask, read without changing it (/proc/self/status; 0o022 where there is none)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def usual_modes(folder: Path) -> None:
    """Give every file under `folder` the mode a plain open() gives (0644 under the usual umask).

    Writers that go through a temporary file (safetensors' save_file, mkstemp) leave 0600: an exported model
    that only its writer can read is no use to the server or the colleague it is for.
    """
    mode = 0o666 & ~umask()
    for path in [folder, *folder.rglob("*")] if folder.is_dir() else [folder]:
        if path.is_file() and not path.is_symlink():
            path.chmod(mode)


def special_kind(path: Path) -> str:
    """What a path that exists but is neither a regular file nor a folder is, in words ("FIFO", ...)."""
    mode = path.stat().st_mode
    for test, name in ((stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return "special file"


def why_missing(path: Path) -> str:
    """Why a path names nothing readable, in words: "not found", or "is" the link that leads nowhere."""
    if not path.is_symlink():
        return "not found"
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "is a symbolic link loop"
        return f"is a symbolic link to {os.readlink(path)}, which is not there"
    return "not found"

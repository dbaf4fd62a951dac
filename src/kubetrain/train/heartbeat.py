"""A worker's side of hang detection: the step it last finished, in a small file the launcher watches.

Under `kubetrain train --nproc` (and in a pod) the launcher names a folder in KUBETRAIN_HEARTBEAT_DIR. Each
worker writes `rank-NNNNN.json` (rank, pid, step, time, restart count, the round's identity) after every step,
registers faulthandler on SIGUSR1 so the launcher can ask for its Python stacks (written to `stacks-rank-NNNNN.txt`),
and asks Linux to kill it when its launcher dies, so a SIGKILLed agent leaves no orphan training on.
Without the variable (one process, a bare torchrun) none of this happens.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import json
import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

HEARTBEAT_DIR_ENV = "KUBETRAIN_HEARTBEAT_DIR"
LAUNCHER_PID_ENV = "KUBETRAIN_LAUNCHER_PID"
STACKS_SIGNAL = signal.SIGUSR1
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
RECORD_BYTES = 1024  # every record padded to this size, so a shorter one never leaves a tail of the last


def beat_file(folder: Path, rank: int) -> Path:
    return folder / f"rank-{rank:05d}.json"


def stacks_file(folder: Path, rank: int) -> Path:
    return folder / f"stacks-rank-{rank:05d}.txt"


def round_identity(env: Mapping[str, str]) -> str:
    """The same string on every node for one rendezvous round of the workers, and a new one at every round.

    TORCHELASTIC_RESTART_COUNT is neither: it counts this node's agent's restarts after a failure, so a node whose
    agent restarted its workers because a peer left (a membership change) keeps its count, and its next round would
    look like a round already handled, where the watch does not act on a hang. The workers' store address is per
    round: the launcher sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 whatever the environment said (with torch's shared
    store the address stays the same from round to round), so rank 0's agent picks a free port for each round's store.
    """
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    return f"{addr}:{port}" if addr and port else f"restart {env.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def die_with_launcher() -> bool:
    """Ask the kernel for SIGKILL when the launcher goes (Linux only); True when that is in place.

    PR_SET_PDEATHSIG fires when the parent *thread* exits; torch's agent starts workers from its main thread,
    which lives as long as the launcher. A launcher that died before the call is caught by the ppid check.
    """
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if not sys.platform.startswith("linux") or not launcher:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return False
    if os.getppid() != int(launcher):  # the launcher is already gone: we are someone else's orphan
        os._exit(1)
    return True


class Heartbeat:
    """This rank's heartbeat file and stack-dump hook; `beat(step)` after each step costs one small write."""

    def __init__(self, folder: Path, rank: int) -> None:
        self.folder, self.rank = folder, rank
        self.path = beat_file(folder, rank)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.round = round_identity(os.environ)
        self.started = time.time()
        self.error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
        self.step = -1
        # faulthandler writes from its C signal handler, so it answers even while Python is stuck in C code
        # (a collective, a read); a SIGSTOPped process cannot answer at all, and the launcher says so.
        self._stacks: IO[str] = open(stacks_file(folder, rank), "a", encoding="utf-8")  # noqa: SIM115
        faulthandler.register(STACKS_SIGNAL, file=self._stacks, all_threads=True, chain=False)

    @classmethod
    def from_env(cls, rank: int) -> Heartbeat | None:
        """The heartbeat the launcher asked for, or None when there is no launcher watching."""
        folder = os.environ.get(HEARTBEAT_DIR_ENV)
        if not folder or not Path(folder).is_dir():
            return None
        die_with_launcher()
        return cls(Path(folder), rank)

    def beat(self, step: int, **extra: Any) -> None:
        """Overwrite this rank's record in place: one pwrite of a fixed-size record, no rename, no fsync (the
        reader is a process on this node; a record caught half-written fails to parse and is read next poll)."""
        self.step = step
        fields = {"rank": self.rank, "pid": os.getpid(), "step": step, "time": time.time(),
                  "restart": self.restart, "round": self.round, "started": self.started,
                  "error_file": self.error_file, **extra}
        record = json.dumps(fields)
        if len(record) > RECORD_BYTES:  # an absurdly long error-file path: the launcher does without it
            record = json.dumps({**fields, "error_file": None})
        # a heartbeat that cannot be written must not stop training; the launcher sees it as silence
        with contextlib.suppress(OSError):
            os.pwrite(self._fd, record.ljust(RECORD_BYTES).encode(), 0)

    def close(self, clean: bool) -> None:
        """A run that finished or stopped cleanly says so; one that failed leaves its last beat for the launcher."""
        if clean:
            self.beat(self.step, done=True)
        faulthandler.unregister(STACKS_SIGNAL)
        self._stacks.close()
        os.close(self._fd)

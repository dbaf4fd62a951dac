"""The preflight's deadline: a rank that does not reach or finish it in time is named by its peers, and the job ends
then, not at the process group's start-up timeout (30 minutes by default).

A collective has no deadline of its own that names anyone: a rank stopped in a device call, or SIGSTOPped, holds its
peers inside the next collective until the group's timeout. So each rank, from a thread of its own, keeps a beat in
the job's rendezvous store (the TCPStore at MASTER_ADDR:MASTER_PORT that the process group was made with): a counter
it raises every BEAT_SECONDS, with the phase its main thread is in. When a rank's preflight has not finished within
the budget plus the margin, the thread reads every rank's beat twice, BEAT_SECONDS x 4 apart: a rank whose counter
did not move does not answer (stopped, or its host gone); a rank that answers but is in an earlier phase than the
others is stuck there. It names them, and ends its own process (its main thread is inside a collective that will not
return). The launcher's hang watch starts at the first step; this is its equivalent before it.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as td

from kubetrain.distributed.preflight_judge import who

PHASES = ("start", "device check", "all-reduce", "send/recv", "clock reading", "gather", "second look", "verdict")
BEAT_SECONDS = 0.5
STORE_TIMEOUT_SECONDS = 5.0  # one store call; a store that does not answer in this long is itself the news
MARGIN_SHARE, MARGIN_MIN_SECONDS = 0.25, 10.0


def margin(budget: float) -> float:
    """What the deadline adds to the budget: the ranks' start skew, the gather and the verdict, which the budget
    does not size (a quarter of the budget, at least 10 s)."""
    return max(MARGIN_MIN_SECONDS, MARGIN_SHARE * budget)


def store_address() -> tuple[str, int] | None:
    """The rendezvous store the job's process group was made with (torchrun's and env://'s variables)."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return (addr, int(port)) if addr and port and port.isdigit() else None


def store_in_rank0() -> bool:
    """Whether the store lives in worker rank 0's process (env://; torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE,
    as kubetrain's launcher sets) rather than in an agent's: then a rank 0 that is stopped takes the store with it."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true"


@dataclass
class Deadline:
    """This rank's beat and its watch over the others; `phase(name)` as the preflight goes, `close()` when done."""

    rank: int
    world: int
    seconds: float
    identity: dict[str, Any]
    on_expiry: Callable[[str, list[int], bool], None]  # (the line, the named ranks, whether this rank says it)
    address: tuple[str, int] | None = None
    current: str = PHASES[0]
    started: float = 0.0  # time.monotonic() at start()
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _prefix: str = ""

    def start(self) -> Deadline:
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self._prefix = f"kubetrain/preflight/{restart}"
        self.started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="kubetrain-preflight-deadline", daemon=True)
        self._thread.start()
        return self

    def phase(self, name: str) -> None:
        self.current = name  # the thread posts it with the next beat: the main thread never waits on the store

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(STORE_TIMEOUT_SECONDS + 1)

    def _run(self) -> None:
        store = None
        if self.address is not None:
            with contextlib.suppress(RuntimeError, ValueError, OSError):
                store = td.TCPStore(self.address[0], self.address[1], is_master=False, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=STORE_TIMEOUT_SECONDS))
                store.set(f"{self._prefix}/who/{self.rank}", json.dumps(self.identity))
        count = 0
        deadline = self.started + self.seconds
        while not self._stop.wait(min(BEAT_SECONDS, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                self._expire(store)
                return
            count += 1
            if store is not None:
                with contextlib.suppress(RuntimeError):  # the store is slow to answer: the next beat tries again
                    store.set(self._key(self.rank), f"{count} {PHASES.index(self.current)}")

    def _key(self, rank: int) -> str:
        return f"{self._prefix}/beat/{rank}"

    def _read(self, store: Any) -> dict[int, tuple[int, int] | None]:
        """Every rank's (beat count, phase index); None for a rank that never beat."""
        out: dict[int, tuple[int, int] | None] = {}
        for r in range(self.world):
            key = self._key(r)
            if not store.check([key]):
                out[r] = None
                continue
            count, phase = store.get(key).decode().split()
            out[r] = (int(count), int(phase))
        return out

    def _expire(self, store: Any) -> None:
        budget = f"{self.seconds:.0f} s (dist.preflight.budget_seconds plus its margin)"
        if store is None:
            self.on_expiry(f"preflight: rank {self.rank} did not finish within {budget}, and the rendezvous store "
                           "cannot be reached to say which rank holds it up", [], True)
            return
        try:
            store.set(self._flag("expired", self.rank), "1")  # alive at its deadline: it may end before others read
            first = self._read(store)
            time.sleep(4 * BEAT_SECONDS)
            second = self._read(store)
            expired = {r for r in range(self.world) if store.check([self._flag("expired", r)])}
            names = {r: self._who(store, r) for r in range(self.world)}
            store.set(self._flag("read", self.rank), "1")
        except RuntimeError as e:  # the store does not answer: where it lives says who
            holder = "rank 0, whose process holds the store, does not answer" if store_in_rank0() else \
                "the rendezvous store does not answer"
            self.on_expiry(f"preflight: not finished within {budget}: {holder} ({type(e).__name__})",
                           [0] if store_in_rank0() and self.rank != 0 else [], self.rank != 0)
            return
        never = [r for r in range(self.world) if second[r] is None]
        seen = {r: beat for r, beat in second.items() if beat is not None}
        silent = [r for r in seen if first[r] == seen[r] and r != self.rank and r not in expired]
        answering = [r for r in seen if r not in silent]
        furthest = max((seen[r][1] for r in answering), default=0)
        behind = [r for r in answering if seen[r][1] < furthest]
        parts = [f"{names[r]} never reached the preflight" for r in never]
        parts += [f"{names[r]} does not answer (stopped, or its host is gone), last seen in its {PHASES[seen[r][1]]}"
                  for r in silent]
        parts += [f"{names[r]} is still in its {PHASES[seen[r][1]]} while others are past it" for r in behind]
        named = never + silent + behind
        if not parts:
            parts = [f"every rank answers and none is behind (all in the {PHASES[furthest]}): the network between "
                     "them?"]
        if self.rank == 0 and store_in_rank0():
            self._hold_store(store, answering)
        # the lowest rank that answers says it for the job: the others only end
        speaker = min(answering, default=self.rank) == self.rank
        self.on_expiry(f"preflight: not finished within {budget}: " + "; ".join(parts), named, speaker)

    def _flag(self, what: str, rank: int) -> str:
        return f"{self._prefix}/{what}/{rank}"

    def _hold_store(self, store: Any, answering: list[int]) -> None:
        """Rank 0's process holds the store: it ends only after the other answering ranks have read it (or a bounded
        wait), so they name the rank that is stuck rather than rank 0 for the store it took with it."""
        store.set(self._flag("read", 0), "1")
        until = time.monotonic() + 4 * BEAT_SECONDS + 2 * STORE_TIMEOUT_SECONDS
        while time.monotonic() < until:
            with contextlib.suppress(RuntimeError):
                if all(store.check([self._flag("read", r)]) for r in answering):
                    return
            time.sleep(BEAT_SECONDS / 2)

    def _who(self, store: Any, rank: int) -> str:
        key = f"{self._prefix}/who/{rank}"
        if not store.check([key]):
            return f"rank {rank}"
        return who(json.loads(store.get(key).decode()))


def end_process(line: str, exit_code: int) -> None:
    """End this process from the deadline's thread (the main thread is inside a collective that will not return):
    the line on stderr and in torch elastic's error file (what its launcher's failure summary reads), then exit."""
    print(f"error: {line}", file=sys.stderr, flush=True)
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with contextlib.suppress(OSError), open(path, "w", encoding="utf-8") as f:
            json.dump({"message": line, "timestamp": int(time.time())}, f)
    sys.stdout.flush()
    os._exit(exit_code)

"""How `logs -f` rides out a control plane that does not answer: how long, how it waits, what it says.

kubectl and stern retry a follow that broke; they do not give up on a schedule. Here one outage (no answer from the
API server, or its own refusal: 429 while it shuts down, 5xx) is said once for every rank's reader together, any
answer ends it, and one that lasts `Patience.give_up_after` ends the follow (GaveUp, exit 1).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from kubetrain.errors import KubetrainError
from kubetrain.k8s.cluster.api_errors import ClusterError


class GaveUp(KubetrainError):
    """`logs -f` gave up: the API server answered nothing for Patience.give_up_after seconds. Exit 1."""


@dataclass(frozen=True)
class Patience:
    """How long `logs -f` rides out a control plane that does not answer, and how it waits between tries."""

    give_up_after: float = 600.0  # seconds without one answer from the API server (--give-up-after)
    first_wait: float = 1.0  # the wait after a failed request, doubled after each further one ...
    longest_wait: float = 30.0  # ... up to this
    idle: float = 60.0  # a followed stream that sends nothing this long is opened again (a stalled kubelet)


class Outage:
    """Whether the API server answers, shared by every rank's reader: the first failed request of an outage is said
    once, any answer ends the outage, and one that lasts `give_up_after` ends the follow."""

    def __init__(self, patience: Patience, lines: queue.Queue[Any], where: str) -> None:
        self.patience, self.lines, self.where = patience, lines, where
        self.since: float | None = None
        self.lock = threading.Lock()

    def answered(self) -> None:
        self.since = None

    def failed(self, error: ClusterError) -> None:
        """A request got no answer (or 429/5xx from the API server itself): say so once, or give up."""
        reason = str(error).rsplit(": ", 1)[-1]
        with self.lock:
            now = time.monotonic()
            if self.since is None:
                self.since = now
                self.lines.put(f"(API server unreachable, retrying for up to {_minutes(self.patience.give_up_after)}: "
                               f"{reason})")
            elif now - self.since >= self.patience.give_up_after:
                raise GaveUp(f"gave up following the logs: the API server at {self.where} answered nothing for "
                             f"{_minutes(now - self.since)} ({reason}); the job may still be running: "
                             "kubetrain k8s status")


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:g} min" if seconds >= 60 else f"{seconds:.0f}s"


def unreachable(error: ClusterError) -> bool:
    """No answer, or the API server's own refusal (429 while it shuts down or sheds load, 503, 504 its timeout)."""
    return error.status is None or error.status in (429, 500, 502, 503, 504)

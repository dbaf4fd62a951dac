"""Metric sinks on rank 0 behind one fan-out; a sink that fails warns once and is switched off."""

from __future__ import annotations

import sys
from typing import Any


class Sink:
    """One destination for metrics. Every method is optional; the fan-out calls them in order."""

    name = "sink"

    def start(self, info: dict[str, Any]) -> None:
        """The run begins (or resumes): run dir, config, parameter count, start step."""

    def log(self, record: dict[str, Any]) -> None:
        """A train or eval record: {"kind", "step", "loss" | "val_loss", "lr", "tokens", ...}."""

    def heartbeat(self, step: int) -> None:
        """The loop finished a step (called every step, so keep it cheap)."""

    def finish(self, status: str) -> None:
        """The run ends: finished, stopped or failed."""


class Fanout(Sink):
    """Sends every call to each sink; an exception in one sink disables it with a single warning."""

    name = "fanout"

    def __init__(self, sinks: list[Sink], warn: Any = None) -> None:
        self.sinks = list(sinks)
        self._warn = warn or (lambda msg: print(f"warning: {msg}", file=sys.stderr, flush=True))

    def _each(self, method: str, *args: Any) -> None:
        for sink in list(self.sinks):
            try:
                getattr(sink, method)(*args)
            except Exception as e:  # a tracker must never stop training
                self.sinks.remove(sink)
                self._warn(f"metrics sink '{sink.name}' failed and is switched off: {type(e).__name__}: {e}")

    def start(self, info: dict[str, Any]) -> None:
        self._each("start", info)

    def log(self, record: dict[str, Any]) -> None:
        self._each("log", record)

    def heartbeat(self, step: int) -> None:
        self._each("heartbeat", step)

    def finish(self, status: str) -> None:
        self._each("finish", status)

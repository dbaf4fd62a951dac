"""Build the fan-out of metric sinks a config asks for (rank 0 only)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kubetrain.config.schema import Config
from kubetrain.runs import METRICS_FILE
from kubetrain.track import Fanout, Sink
from kubetrain.track.console import ConsoleSink
from kubetrain.track.jsonl import JsonlSink


def build_sinks(cfg: Config, run_path: Path, total_steps: int, stream: Any = None, warn: Any = None) -> Fanout:
    sinks: list[Sink] = [JsonlSink(run_path / METRICS_FILE)]
    if cfg.track.console:
        sinks.append(ConsoleSink(total_steps, stream=stream))
    return Fanout(sinks, warn=warn)

"""Where a run directory is and what its files are called.

runs/<run-id>/  config.yaml  meta.json  metrics.jsonl  samples.txt  tokenizer/  checkpoints/  phases/<phase>/
                phases.json (a run of phases)
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pydantic's schema: `runs list` reads run folders without it
    from kubetrain.config.schema import Config

CONFIG_FILE = "config.yaml"
META_FILE = "meta.json"
METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.txt"
CHECKPOINTS = "checkpoints"
PHASES = "phases"
PHASES_FILE = "phases.json"  # a run of phases: their names in order, and how the whole run stands
PREFLIGHT_FILE = "preflight.json"  # the job's preflight before step 1 (distributed/preflight.py), once per run

STATUSES = ("running", "stopped", "finished", "failed")


def run_dir(cfg: Config) -> Path:
    return Path(cfg.run.output_dir).expanduser() / cfg.run.name

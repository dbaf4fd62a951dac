"""The run directory: layout (runs.layout), starting it and keeping its meta.json (runs.rundir), and reading
runs back for `kubetrain runs list/show/compare/plot` (runs.reader, runs.compare, runs.plots).

Callers say `from kubetrain import runs` and `runs.start(...)`, `runs.read_meta(...)`, `runs.CHECKPOINTS`.
"""

from kubetrain.runs.layout import (
    CHECKPOINTS,
    CONFIG_FILE,
    META_FILE,
    METRICS_FILE,
    PHASES,
    PREFLIGHT_FILE,
    SAMPLES_FILE,
    STATUSES,
    run_dir,
)
from kubetrain.runs.reader import (
    RunRecords,
    describe_run,
    expand,
    last_finished_phase,
    list_runs,
    phase_dirs,
    read_config,
    read_meta,
    read_metrics,
    read_preflight,
)
from kubetrain.runs.rundir import config_changes, git_sha, record_phases, record_tracker, start, update_meta

__all__ = [
    "CHECKPOINTS",
    "CONFIG_FILE",
    "META_FILE",
    "METRICS_FILE",
    "PHASES",
    "PREFLIGHT_FILE",
    "SAMPLES_FILE",
    "STATUSES",
    "RunRecords",
    "config_changes",
    "describe_run",
    "expand",
    "git_sha",
    "last_finished_phase",
    "list_runs",
    "phase_dirs",
    "read_config",
    "read_meta",
    "read_metrics",
    "read_preflight",
    "record_phases",
    "record_tracker",
    "run_dir",
    "start",
    "update_meta",
]

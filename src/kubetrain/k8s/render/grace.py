"""How long a stopped pod gets to save: the default rule, or the save time a previous run measured.

A pod asked to stop (SIGTERM: a node drain, preemption, `k8s stop`) finishes its step, saves a checkpoint
and exits 75; the kubelet kills it `terminationGracePeriodSeconds` after the signal. The default rule gives
checkpoint.grace_seconds plus GRACE_MARGIN. A model whose save takes longer than that is killed mid-save every
time (nothing is lost, the layout is atomic, but the run resumes from the checkpoint before). So where the
run directory the config names holds a measured save (metrics.jsonl's checkpoint lines carry `write_seconds`,
the whole save), render gives the save SAVE_FACTOR times that long plus SAVE_MARGIN, when that is more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from kubetrain.config.schema import Config
from kubetrain.runs.layout import METRICS_FILE, run_dir
from kubetrain.runs.reader import phase_dirs, read_metrics

# Seconds a pod gets beyond the checkpoint grace: torchrun's shutdown and process exit after the save.
GRACE_MARGIN = 30
# A measured save is a figure from another moment: during a drain the other pods of the node stop too and the
# claim's storage is shared by all ranks' writes, so the stop save gets half as long again as it took.
SAVE_FACTOR = 1.5
# The loop saves after the step in flight and the one after it (every rank agrees to stop at the same step,
# see train/stop.py StopVote), and an evaluation when one is due: time for that on top of the save.
SAVE_MARGIN = 20


@dataclass(frozen=True)
class MeasuredSave:
    """The save a run directory (or a pod's log) recorded: how long it took, at which step, and where."""

    write_seconds: float
    step: int
    source: str  # the run directory (or pod) it was read from

    @property
    def needs(self) -> int:
        """Seconds the loop should be given to save after a stop: the measured save with its headroom."""
        return math.ceil(self.write_seconds * SAVE_FACTOR) + SAVE_MARGIN

    def describe(self) -> str:
        return f"measured write {self.write_seconds:.1f} s at step {self.step} of {self.source}"


def last_save(metrics: Path, source: str) -> MeasuredSave | None:
    """The last checkpoint line of a metrics.jsonl that carries `write_seconds` (on resume the file is cut back
    to the resumed step, so the last line is the newest checkpoint)."""
    for record in reversed(read_metrics(metrics)):
        if record.get("kind") == "checkpoint" and isinstance(record.get("write_seconds"), int | float):
            return MeasuredSave(float(record["write_seconds"]), int(record.get("step") or 0), source)
    return None


def measured_in(run: Path) -> MeasuredSave | None:
    """The newest save of a run directory; of a multi-phase run, the longest of its phases' newest saves (the
    pod may be stopped in any phase, and a later phase can save a bigger state: LoRA vs full weights)."""
    found = [last_save(d / METRICS_FILE, str(d)) for d in [run, *phase_dirs(run)]]
    saves = [s for s in found if s is not None]
    return max(saves, key=lambda s: s.write_seconds, default=None)


def local_run_dirs(cfg: Config) -> list[Path]:
    """Where a run of this config is on this machine: the run directory it names (a local run), and runs/<name>,
    where `kubetrain k8s fetch` puts a job's run by default."""
    named = run_dir(cfg)
    fetched = Path("runs") / cfg.run.name
    return [named] if named.resolve() == fetched.resolve() else [named, fetched]


def measured_locally(cfg: Config) -> MeasuredSave | None:
    """The longest newest save among the local copies of this config's run; None when there is none."""
    saves = [s for s in (measured_in(d) for d in local_run_dirs(cfg) if d.is_dir()) if s is not None]
    return max(saves, key=lambda s: s.write_seconds, default=None)


def checkpoint_grace(cfg: Config, measured: MeasuredSave | None) -> float:
    """checkpoint.grace_seconds of the pods: the configured one, or the measured save's need when that is more.
    An explicit k8s.grace_period_seconds keeps the configured one (the user chose both; render warns)."""
    configured = cfg.checkpoint.grace_seconds
    if measured is None or cfg.k8s.grace_period_seconds is not None:
        return configured
    return max(configured, float(measured.needs))


def pod_grace(cfg: Config, measured: MeasuredSave | None) -> int:
    """terminationGracePeriodSeconds: k8s.grace_period_seconds, else the pods' checkpoint grace + GRACE_MARGIN."""
    if cfg.k8s.grace_period_seconds is not None:
        return cfg.k8s.grace_period_seconds
    return math.ceil(checkpoint_grace(cfg, measured)) + GRACE_MARGIN


def grace_origin(cfg: Config, measured: MeasuredSave | None) -> str:
    """Where the grace comes from, in words (for `k8s doctor` and render's note)."""
    if cfg.k8s.grace_period_seconds is not None:
        return "k8s.grace_period_seconds"
    configured = cfg.checkpoint.grace_seconds
    if measured is not None and measured.needs > configured:
        return (f"{measured.describe()} (x{SAVE_FACTOR:g} + {SAVE_MARGIN} s to finish the step, "
                f"+ {GRACE_MARGIN} s for torchrun to exit)")
    rule = f"the default rule: checkpoint.grace_seconds {configured:g} + {GRACE_MARGIN}"
    return rule + (f"; {measured.describe()} needs less" if measured is not None else "")


def too_short(cfg: Config, measured: MeasuredSave | None) -> str | None:
    """One line when an explicit k8s.grace_period_seconds is shorter than what the measured save needs.

    A warning, not a refusal: the figure is from an earlier run (other storage, another model size), and a pod
    killed mid-save loses nothing but the steps since the checkpoint before (the layout is atomic).
    """
    explicit = cfg.k8s.grace_period_seconds
    if explicit is None or measured is None:
        return None
    wanted = measured.needs + GRACE_MARGIN
    if explicit >= wanted:
        return None
    return (f"warning: k8s.grace_period_seconds ({explicit}) is shorter than the {wanted} s a save needs "
            f"({measured.describe()}): a stopped pod may be killed mid-save and resume from the checkpoint before; "
            "raise it, or leave it unset to follow the measurement")


def render_note(cfg: Config, measured: MeasuredSave | None) -> str | None:
    """One line for render's stderr when a measurement changed the manifest (a GitOps diff then says why), or
    the warning of `too_short`; None when the default rule stands."""
    warning = too_short(cfg, measured)
    if warning is not None:
        return warning
    if measured is None or checkpoint_grace(cfg, measured) == cfg.checkpoint.grace_seconds:
        return None
    return (f"note: terminationGracePeriodSeconds {pod_grace(cfg, measured)} and checkpoint.grace_seconds "
            f"{checkpoint_grace(cfg, measured):g} in the pods follow the {measured.describe()}")

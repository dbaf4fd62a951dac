"""The clocks of "no progress", all derived here from the user's settings, in the order they act.

A hung job is noticed by several parties: the alert rule (a person is paged), the launcher's hang watch (names
the stuck rank, dumps every rank's stacks, ends the workers for a restart), the collective timeout (NCCL/gloo
abort inside the workers, on NCCL with the flight recorder's dump) and the pod's liveness probe (the kubelet
kills the container). Only the first to act can say who was stuck, so they act in this order:

    alert  <  hang watch (+ its stacks wait)  <  collective timeout  <  liveness (+ the probe's failures)

`dist.hang_timeout_seconds` is the one setting that moves them all; each of the others may be set too, and a
set where a later clock would act before an earlier one is refused in one line (config validation, exit 2).
Before the first step only the generous start-up collective timeout applies (the heartbeat file exists from the
first step on, so the watch and the alert look at running jobs only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kubetrain.config.schema import Config, DistConfig

# The watch polls 4 times a second, waits up to 3 s for the stacks, then SIGKILLs: it needs this much after
# its timeout before anything else may end the workers (launch/watch.py STACKS_WAIT_SECONDS, with room to spare).
WATCH_ACTS_WITHIN = 15.0
# The liveness probe (k8s/render/podspec.py): every PROBE_PERIOD s, killed after PROBE_FAILURES failures.
PROBE_PERIOD = 30
PROBE_FAILURES = 3
NO_WATCH_COLLECTIVE = 900.0  # the collective timeout when the hang watch is off and none is set
ALERT_SHARE = 0.5  # the alert fires after this share of the watch's timeout: live processes to look at


@dataclass(frozen=True)
class Clocks:
    """Seconds without a finished step after which each party acts (the start-up timeout: since the start)."""

    alert: float  # the hang alert fires (the launcher exports it as kubetrain_hang_alert_seconds)
    hang_watch: float | None  # the launcher names the stuck rank, dumps stacks, ends the workers (None: off)
    collective_startup: float  # a collective fails after this, until the first step is done
    collective_step: float  # a collective fails after this, from the first step on
    liveness: float  # /healthz answers 503 (the probe then kills after PROBE_FAILURES x PROBE_PERIOD)

    @property
    def liveness_kill(self) -> float:
        """When the kubelet kills the container at the latest, counted like the others."""
        return self.liveness + PROBE_FAILURES * PROBE_PERIOD

    def timeline(self) -> list[tuple[float, str]]:
        """(seconds without a step, what happens), in order: what `config explain` and the docs show."""
        steps = [(self.alert, "the hang alert fires (KubetrainTrainingHung)")]
        if self.hang_watch is not None:
            steps.append((self.hang_watch, "the hang watch names the stuck rank, dumps stacks, ends the workers"))
        steps += [(self.collective_step, "a collective times out (NCCL: flight recorder dump)"),
                  (self.liveness, "/healthz answers 503"),
                  (self.liveness_kill, "the liveness probe has failed 3 times: the kubelet restarts the pod")]
        return steps


def collective_timeouts(dist: DistConfig) -> tuple[float, float]:
    """(until the first step, after it): what distributed/setup.py gives the process group."""
    step = collective_step(dist)
    return max(float(dist.init_timeout_seconds), step), step


def collective_step(dist: DistConfig) -> float:
    """dist.timeout_seconds, or the hang watch's timeout plus the time the watch needs to act."""
    if dist.timeout_seconds is not None:
        return float(dist.timeout_seconds)
    hang = dist.hang_timeout_seconds
    if hang is None:
        return NO_WATCH_COLLECTIVE
    return hang + max(hang / 2, WATCH_ACTS_WITHIN)


def hang_watch(dist: DistConfig) -> float | None:
    """dist.hang_timeout_seconds; where it is at its default and dist.timeout_seconds is set (alone, or a config
    of an earlier version holding that version's default, 600), the watch follows the collective timeout instead,
    the inverse of `collective_step`, so that one setting still gives a consistent set."""
    hang = dist.hang_timeout_seconds
    default = type(dist).model_fields["hang_timeout_seconds"].default
    if hang is None or dist.timeout_seconds is None or hang != default:
        return hang
    step = float(dist.timeout_seconds)
    return step / 1.5 if step >= 3 * WATCH_ACTS_WITHIN else max(1.0, step - WATCH_ACTS_WITHIN)


def derive(cfg: Config) -> Clocks:
    """Every "no progress" clock of this config (no checks: `check` refuses a set in the wrong order)."""
    dist = cfg.dist
    startup, step = collective_timeouts(dist)
    hang = hang_watch(dist)
    # liveness after the collective timeout, and after a stop's save (the grace) on top: a pod that is saving
    # its checkpoint finishes no step, and the probe must not kill it for that
    liveness = cfg.track.prometheus.health_timeout_seconds
    if liveness is None:
        liveness = step + WATCH_ACTS_WITHIN + cfg.checkpoint.grace_seconds
    alert = (hang if hang is not None else step) * ALERT_SHARE
    return Clocks(alert=alert, hang_watch=hang, collective_startup=startup, collective_step=step,
                  liveness=liveness)


def check(cfg: Config) -> None:
    """Raise ValueError (one line) when a later clock would act before an earlier one."""
    dist, clocks = cfg.dist, derive(cfg)
    hang = clocks.hang_watch
    if hang is not None and dist.timeout_seconds is not None and clocks.collective_step < hang + WATCH_ACTS_WITHIN:
        raise ValueError(
            f"dist.timeout_seconds ({dist.timeout_seconds:g}) must be at least dist.hang_timeout_seconds + "
            f"{WATCH_ACTS_WITHIN:g} ({hang + WATCH_ACTS_WITHIN:g}): the hang watch names the stuck rank before a "
            "collective times out; set only dist.hang_timeout_seconds (the others follow it), or null to turn "
            "the watch off")
    if cfg.track.prometheus.health_timeout_seconds is not None and clocks.liveness < clocks.collective_step:
        raise ValueError(
            f"track.prometheus.health_timeout_seconds ({clocks.liveness:g}) must be at least the collective "
            f"timeout ({clocks.collective_step:g}): liveness would kill the pod before the hang is named; leave it "
            "unset (derived) or raise it")

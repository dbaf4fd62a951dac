"""`k8s doctor`'s grace line: the grace period launch renders, where it came from, and the save time the
job's pods logged (the trainer's checkpoint line, read back from rank 0's log) when that needs more.

Launch does not render from the logs: a running job's pod template cannot change (a Job's is immutable), and
once the job is stopped its pods and their logs are gone. The run directory keeps the figure: `kubetrain k8s
fetch NAME` brings it where render looks (k8s/render/grace.py).
"""

from __future__ import annotations

from collections.abc import Iterable

from kubetrain.k8s.cluster.api import Cluster
from kubetrain.k8s.cluster.api_errors import ClusterError
from kubetrain.k8s.cluster.status import job_ranks, main_container
from kubetrain.k8s.render.context import RenderContext
from kubetrain.k8s.render.grace import SAVE_FACTOR, MeasuredSave, too_short
from kubetrain.track.console import checkpoint_in

# Lines of the log read back: a checkpoint line comes every checkpoint.every_steps / train.log_every_steps
# progress lines (25 to 100 in the examples), so this holds the newest save without reading a week of log.
LOG_TAIL = 5000


def saves_in(lines: Iterable[str], source: str) -> MeasuredSave | None:
    """The newest save among log lines (a pod's log runs in time order)."""
    newest = None
    for line in lines:
        found = checkpoint_in(line)  # the trainer's checkpoint line (track.console.checkpoint_line)
        if found:
            newest = MeasuredSave(found[1], found[0], source)
    return newest


def logged_save(cluster: Cluster, name: str, namespace: str) -> MeasuredSave | None:
    """The newest save the job's rank-0 pod logged (global rank 0 logs it); None without pods or such lines.

    A pod whose log cannot be read (not started, forbidden) is passed over: this is advice, not a check.
    """
    found = []
    for rank in job_ranks(cluster, name, namespace):
        if rank.rank not in (0, None) or rank.phase not in ("Running", "Succeeded", "Failed"):
            continue
        try:
            save = saves_in(cluster.log_lines(rank.name, namespace, main_container(rank.pod), tail=LOG_TAIL),
                            f"pod {rank.name}'s log")
        except ClusterError:
            continue
        if save is not None:
            found.append(save)
    return max(found, key=lambda s: s.step, default=None)


def outgrows(save: MeasuredSave, grace: float) -> bool:
    """The save itself, with the headroom of a drain (SAVE_FACTOR), does not fit in `grace`.

    Not `save.needs > grace`: `needs` adds SAVE_MARGIN, the rule's own allowance for the steps before the save,
    which is what a grace the user chose already covers; with it a 0.1 s save "needed 21 s" of a 20 s grace."""
    return save.write_seconds * SAVE_FACTOR > grace


def grace_verdict(cluster: Cluster, ctx: RenderContext) -> tuple[str, str]:
    """(ok | warn, one line): the grace and its origin; a warning when an explicit k8s.grace_period_seconds is
    shorter than the measured save, or when the job's pods logged a save that does not fit in what it gives."""
    detail = f"terminationGracePeriodSeconds {ctx.grace_seconds} s from {ctx.grace_origin}"
    logged = logged_save(cluster, ctx.name, ctx.namespace)
    short = too_short(ctx.cfg, ctx.measured) or too_short(ctx.cfg, logged)
    if short is not None:  # an explicit k8s.grace_period_seconds: the user's to raise
        return "warn", f"{detail}; {short.removeprefix('warning: ')}"
    if logged is not None and ctx.k.grace_period_seconds is None and outgrows(logged, ctx.checkpoint_grace):
        return "warn", (f"{detail}; {logged.describe()} needs {logged.needs} s to save: "
                        f"`kubetrain k8s fetch {ctx.name}`, and render follows it")
    return "ok", detail

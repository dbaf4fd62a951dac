"""Before step 1 of a job of several processes: every rank's device and links measured, and a bad one named.

The worker's start path (train/phases.py) calls `check_job` once per process, after the process group is made and
before any model is built. Every rank checks its device (distributed/device_check.py), then the job measures its
links on a group made for the check and compares the ranks' clocks (distributed/links.py); the verdict
(distributed/preflight_judge.py) judges each link within its class (same node, across nodes) and the all-reduce as
one job figure. A phase that does not end in time is named through the rendezvous store
(distributed/preflight_deadline.py). Rank 0 prints the table and writes it to `<run>/preflight.json`; a stop raises
PreflightFailed (exit 71) on every rank, which the launcher does not restart and a rendered Job's podFailurePolicy
turns into a failed Job, with an incident `preflight` in the run folder.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as td

from kubetrain.config.preflight import PreflightConfig
from kubetrain.distributed import links
from kubetrain.distributed.device_check import check_device
from kubetrain.distributed.env import NODE_NAME_ENV, POD_NAME_ENV, ProcessEnv
from kubetrain.distributed.preflight_deadline import Deadline, end_process, margin, store_address
from kubetrain.distributed.preflight_judge import CLASS_WORDS, gbps, judge
from kubetrain.errors import EXIT_FAILURE, EXIT_PREFLIGHT, PreflightFailed
from kubetrain.files import write_atomic
from kubetrain.runs.layout import PREFLIGHT_FILE

ALL_REDUCE_SHARE, LINK_SHARE = 0.5, 0.35  # of the budget left after the device check; the rest: clocks, gather
GB = 1e9

Log = Callable[[str], None]


def stops(cfg: PreflightConfig) -> bool:
    """Whether a certain problem ends the job: `stop`, or `auto` in a pod rendered by kubetrain. A problem that is
    not certain (a link slower than its class, but within the noise a loaded host makes) warns under every setting."""
    return cfg.on_failure == "stop" or (cfg.on_failure == "auto" and bool(os.environ.get(POD_NAME_ENV)))


def check_job(cfg: PreflightConfig, penv: ProcessEnv, device: torch.device, run_dir: Path, log: Log,
              write: bool = True) -> dict[str, Any] | None:
    """Run the preflight (collective: every rank calls it, once per process group); the report, or None when off.

    Rank 0 prints the table and (`write`) keeps it in `run_dir/preflight.json`; certain problems raise
    PreflightFailed on every rank where `stops(cfg)`, the others are printed as warnings.
    """
    if not (cfg.enabled and penv.distributed and td.is_initialized()):
        return None
    stop = stops(cfg)

    def expired(line: str, named: list[int], speaker: bool) -> None:
        """The deadline passed: the rank that speaks for the job records it; every rank ends. Exit 71 (the Job fails
        for good) only under `stop`: a rank silent for the budget may be a node that comes back, and under `auto`
        the launcher's restarts and the pod's backoff decide."""
        if speaker and write:
            _record(run_dir, line, named)
        end_process(line, EXIT_PREFLIGHT if cfg.on_failure == "stop" else EXIT_FAILURE)

    limit = cfg.budget_seconds + margin(cfg.budget_seconds)
    deadline = Deadline(penv.rank, penv.world_size, limit, identity(penv.rank), expired, store_address()).start()
    try:
        report = measure(cfg, device, penv.rank, penv.world_size, deadline, limit)
    finally:
        deadline.close()
    report["on_failure"] = "stop" if stop else "warn"
    verdict = report["verdict"]
    if penv.is_main:
        for line in table(report):
            log(line)
        if write:
            run_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(run_dir / PREFLIGHT_FILE, json.dumps(report, indent=2) + "\n")
        for line in verdict["warnings"]:
            log(f"preflight: warning: {line}")
    stopping = verdict["certain"] if stop else []
    going_on = [p for p in verdict["problems"] if p not in stopping]
    if going_on and penv.is_main:
        why = "not certain, training goes on" if stop else "training goes on"
        log(f"preflight: {'; '.join(going_on)} (dist.preflight.on_failure {cfg.on_failure}: {why})")
    if not stopping:
        return report
    message = "preflight: " + "; ".join(stopping)
    if penv.is_main and write:
        _record(run_dir, message, verdict["certain_ranks"])
    raise PreflightFailed(message)


def _record(run_dir: Path, message: str, named: list[int]) -> None:
    """An incident `preflight` in the run folder, and its line (unprefixed, as the launcher prints its incidents:
    `k8s status` reads it from the pod's log)."""
    from kubetrain.runs import incidents

    entry = incidents.record(run_dir, "preflight", rank=named[0] if named else None, step=None, message=message,
                             ranks=named)
    print(incidents.log_line(entry), file=sys.stderr, flush=True)


def identity(rank: int) -> dict[str, Any]:
    """This rank's pod and node (a pod's downward API; the host name elsewhere)."""
    host = socket.gethostname()
    return {"rank": rank, "pod": os.environ.get(POD_NAME_ENV) or None,
            "node": os.environ.get(NODE_NAME_ENV) or host}


def measure(cfg: PreflightConfig, device: torch.device, rank: int, world: int, deadline: Deadline,
            limit: float) -> dict[str, Any]:
    """The whole preflight on this rank; every rank returns the same report (gathered, then judged).

    The links are measured on a group made for the check, with the deadline as its timeout, and destroyed after it:
    with it go the communicators NCCL made for each send/recv pair (held for the rest of the run otherwise).
    """
    started = time.perf_counter()
    deadline.phase("device check")
    mine: dict[str, Any] = {**identity(rank), "device": check_device(device)}
    deadline.phase("all-reduce")
    group = td.new_group(timeout=datetime.timedelta(seconds=limit + margin(cfg.budget_seconds)))
    try:
        left = max(0.0, cfg.budget_seconds - (time.perf_counter() - started))
        sweep = links.all_reduce_sweep(device, world, left * ALL_REDUCE_SHARE, group)
        rows = sweep["sizes"]
        best = max(row["busbw"] for row in rows)  # past saturation a bigger size can measure lower (cache, jitter)
        mine["all_reduce"] = {"latency_seconds": sweep["latency_seconds"], "busbw": best, "sizes": rows}
        slowest = links.agreed_max([rows[-1]["seconds"]], device, group)[0]
        size = links.link_size(rows, slowest, world, left * LINK_SHARE)
        deadline.phase("send/recv")
        links_started = time.perf_counter()
        mine["links"] = sorted(links.link_sweep(device, rank, world, size, group).items())
        links_seconds = time.perf_counter() - links_started
        deadline.phase("clock reading")
        mine["clock_offset_seconds"] = links.clock_offsets(device, world, group=group)[rank]
        deadline.phase("gather")
        everyone: list[Any] = [None] * world
        td.all_gather_object(everyone, mine, group=group)
        report: dict[str, Any] = {
            "version": 2, "world_size": world, "backend": str(td.get_backend()), "device_type": device.type,
            "budget_seconds": cfg.budget_seconds, "all_reduce_bytes": rows[-1]["bytes"], "link_bytes": size,
            "ranks": everyone, "links": link_table(everyone),
        }
        report["verdict"] = judge(report, cfg)
        measured = [p for p in report["verdict"]["problems"] if "all-reduce" in p or "send/recv" in p]
        if measured:  # the same on every rank: the verdict is computed from the same gathered table
            cost = 1.5 * links_seconds + slowest * 6
            used, cost = links.agreed_max([time.perf_counter() - started, cost], device, group)
            if used + cost <= cfg.budget_seconds:
                deadline.phase("second look")
                second_look(report, device, rank, world, group)
                report["verdict"] = judge(report, cfg)
        deadline.phase("verdict")
        links.barrier(device, group)  # every rank is past the last collective before the group goes
    finally:
        td.destroy_process_group(group)
    report["seconds"] = round(time.perf_counter() - started, 3)
    return report


def second_look(report: dict[str, Any], device: torch.device, rank: int, world: int,
                group: td.ProcessGroup) -> None:
    """Measure the bandwidths again after a first look that named a link or missed a floor, and keep each figure's
    better look: a rank descheduled through all its tries (a busy host) rarely is twice, a slow link always is."""
    busbw = links.all_reduce_busbw(device, world, report["all_reduce_bytes"], group)
    pairs = links.link_sweep(device, rank, world, report["link_bytes"], group)
    again: list[Any] = [None] * world
    td.all_gather_object(again, {"busbw": busbw, "links": pairs}, group=group)
    for entry, second in zip(report["ranks"], again, strict=True):
        entry["all_reduce"]["second_look_busbw"] = second["busbw"]
        entry["all_reduce"]["busbw"] = max(entry["all_reduce"]["busbw"], second["busbw"])
        entry["links"] = sorted((peer, max(bw, second["links"].get(peer, 0.0))) for peer, bw in entry["links"])
    report["links"] = link_table(report["ranks"])
    report["second_look"] = True


def link_table(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each ring link once, with the higher of its two ends' measurements: both time the same ping-pong, a slow link
    slows both, and a late start (the other end still leaving the barrier, descheduled) only one."""
    seen: dict[tuple[int, int], float] = {}
    for entry in ranks:
        for peer, bandwidth in entry["links"]:
            key = (min(entry["rank"], peer), max(entry["rank"], peer))
            seen[key] = max(seen.get(key, bandwidth), bandwidth)
    return [{"ranks": list(key), "bandwidth": value} for key, value in sorted(seen.items())]


def table(report: dict[str, Any]) -> list[str]:
    """The lines rank 0 prints: a head, one row per rank, the verdict."""
    verdict = report["verdict"]
    head = (f"preflight: {report['world_size']} ranks over {report['backend']} in {report['seconds']:.1f} s "
            f"(budget {report['budget_seconds']:g} s): all-reduce up to {report['all_reduce_bytes'] // links.MiB} "
            f"MiB, send/recv {report['link_bytes'] // links.MiB} MiB to ring neighbours")
    lines = [head, f"  {'rank':>4}  {'pod/node':<28} {'matmul err':>10} {'memory':>8} {'all-reduce':>12} "
                   f"{'latency':>9} {'send/recv min':>14} {'clock':>8}"]
    for entry in report["ranks"]:
        device, reduce = entry["device"], entry["all_reduce"]
        error = device["matmul"].get("relative_error")
        memory = "ok" if device["memory"]["ok"] else "FAILED"
        slowest = min((bw for _, bw in entry["links"]), default=float("nan"))
        where = (f"{entry['pod']}/{entry['node']}" if entry.get("pod") else entry["node"])[:28]
        lines.append(f"  {entry['rank']:>4}  {where:<28} {'-' if error is None else f'{error:.1e}':>10} "
                     f"{memory:>8} {gbps(reduce['busbw']):>12} {reduce['latency_seconds'] * 1e3:>7.2f}ms "
                     f"{gbps(slowest):>14} {entry['clock_offset_seconds']:>+7.3f}s")
    if verdict["ok"]:
        classes = report.get("link_classes", {})
        medians = ", ".join(f"{CLASS_WORDS[kind]} {gbps(c['median'])}" for kind, c in sorted(classes.items(),
                                                                                                reverse=True))
        figure = report.get("all_reduce_busbw", report.get("median_all_reduce_busbw", float("nan")))
        lines.append(f"preflight: ok (job all-reduce {gbps(figure)}, send/recv median {medians or '-'})")
    return lines


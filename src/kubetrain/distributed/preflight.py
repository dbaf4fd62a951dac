"""Before step 1 of a job of several processes: every rank's device and links measured, and a bad one named.

After the rendezvous and before the model is built, every rank checks its device (distributed/device_check.py),
then the job measures its links on its own group and backend and compares the ranks' clocks
(distributed/links.py). The verdict names each rank whose device fails, whose all-reduce bus bandwidth is below
`min_bandwidth_fraction` of the median (or under the floor), and each slow link with its two ranks:
`preflight: rank 5 (pod X, node Y): all-reduce 0.9 GB/s, median 11.8 GB/s`. Rank 0 prints the table and writes
it to `<run>/preflight.json`; with `on_failure: stop` every rank raises PreflightFailed (exit 71), which the
launcher does not restart and a rendered Job's podFailurePolicy turns into a failed Job, with an incident
`preflight` in the run folder.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
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
from kubetrain.errors import PreflightFailed
from kubetrain.files import write_atomic
from kubetrain.runs.layout import PREFLIGHT_FILE

CLOCK_SKEW_WARN_SECONDS = 1.0  # the hang watch and the ETA compare wall clocks across nodes: a warning, not a stop
ALL_REDUCE_SHARE, LINK_SHARE = 0.5, 0.35  # of the budget left after the device check; the rest: clocks, gather
GB = 1e9

Log = Callable[[str], None]
# Once per process: a worker joins one job's group, which the phases of a run share (an elastic restart is a new
# process, and checks again). A flag, not the group: holding the group kept its gloo threads alive past teardown.
_checked = False


def stops(cfg: PreflightConfig) -> bool:
    """Whether a failed preflight ends the job: `stop`, or `auto` in a pod rendered by kubetrain."""
    return cfg.on_failure == "stop" or (cfg.on_failure == "auto" and bool(os.environ.get(POD_NAME_ENV)))


def check_job(cfg: PreflightConfig, penv: ProcessEnv, device: torch.device, run_dir: Path, log: Log,
              write: bool = True) -> dict[str, Any] | None:
    """Run the preflight once per process (collective: every rank calls it); the report, or None when off.

    Rank 0 prints the table and (`write`) keeps it in `run_dir/preflight.json`; a failure raises PreflightFailed
    on every rank under `stop`, and is printed as a warning under `warn`.
    """
    global _checked
    if not (cfg.enabled and penv.distributed and td.is_initialized()) or _checked:
        return None
    _checked = True
    report = measure(cfg, device, penv.rank, penv.world_size)
    report["on_failure"] = "stop" if stops(cfg) else "warn"
    verdict = report["verdict"]
    if penv.is_main:
        for line in table(report):
            log(line)
        if write:
            run_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(run_dir / PREFLIGHT_FILE, json.dumps(report, indent=2) + "\n")
        for line in verdict["warnings"]:
            log(f"preflight: warning: {line}")
    if verdict["ok"]:
        return report
    message = "preflight: " + "; ".join(verdict["problems"])
    if report["on_failure"] == "warn":
        if penv.is_main:
            log(f"{message} (dist.preflight.on_failure warn: training goes on)")
        return report
    if penv.is_main and write:
        from kubetrain.runs import incidents

        entry = incidents.record(run_dir, "preflight", rank=verdict["named_ranks"][0], step=None, message=message,
                                 ranks=verdict["named_ranks"])
        # unprefixed, as the launcher prints its incidents: `k8s status` reads this line from the pod's log
        print(incidents.log_line(entry), file=sys.stderr, flush=True)
    links.barrier(device)  # every rank is past the last collective before any leaves the group
    raise PreflightFailed(message)


def identity(rank: int) -> dict[str, Any]:
    """This rank's pod and node (a pod's downward API; the host name elsewhere)."""
    host = socket.gethostname()
    return {"rank": rank, "pod": os.environ.get(POD_NAME_ENV) or None,
            "node": os.environ.get(NODE_NAME_ENV) or host}


def who(entry: dict[str, Any]) -> str:
    """`rank 5 (pod X, node Y)`, or `rank 5 (node Y)` outside Kubernetes."""
    pod = f"pod {entry['pod']}, " if entry.get("pod") else ""
    return f"rank {entry['rank']} ({pod}node {entry['node']})"


def measure(cfg: PreflightConfig, device: torch.device, rank: int, world: int) -> dict[str, Any]:
    """The whole preflight on this rank; every rank returns the same report (gathered, then judged)."""
    started = time.perf_counter()
    mine: dict[str, Any] = {**identity(rank), "device": check_device(device)}
    left = max(0.0, cfg.budget_seconds - (time.perf_counter() - started))
    sweep = links.all_reduce_sweep(device, world, left * ALL_REDUCE_SHARE)
    rows = sweep["sizes"]
    best = max(row["busbw"] for row in rows)  # past saturation a bigger size can measure lower (cache, jitter)
    mine["all_reduce"] = {"latency_seconds": sweep["latency_seconds"], "busbw": best, "sizes": rows}
    slowest = links.agreed_max([rows[-1]["seconds"]], device)[0]
    size = links.link_size(rows, slowest, world, left * LINK_SHARE)
    links_started = time.perf_counter()
    mine["links"] = sorted(links.link_sweep(device, rank, world, size).items())
    links_seconds = time.perf_counter() - links_started
    mine["clock_offset_seconds"] = links.clock_offsets(device, world)[rank]
    everyone: list[Any] = [None] * world
    td.all_gather_object(everyone, mine)
    report: dict[str, Any] = {
        "version": 1, "world_size": world, "backend": str(td.get_backend()), "device_type": device.type,
        "budget_seconds": cfg.budget_seconds, "all_reduce_bytes": rows[-1]["bytes"], "link_bytes": size,
        "ranks": everyone, "links": link_table(everyone),
    }
    report["verdict"] = judge(report, cfg)
    if any("all-reduce" in p or "send/recv" in p for p in report["verdict"]["problems"]):  # the same on every rank
        used, cost = links.agreed_max([time.perf_counter() - started, 1.5 * links_seconds + slowest * 6], device)
        if used + cost <= cfg.budget_seconds:
            second_look(report, device, rank, world)
            report["verdict"] = judge(report, cfg)
    report["seconds"] = round(time.perf_counter() - started, 3)
    return report


def second_look(report: dict[str, Any], device: torch.device, rank: int, world: int) -> None:
    """Measure the bandwidths again after a first look that named a rank, and keep each figure's better look: a
    rank descheduled through all its tries (a busy host) rarely is twice, a slow link always is (collective)."""
    busbw = links.all_reduce_busbw(device, world, report["all_reduce_bytes"])
    pairs = links.link_sweep(device, rank, world, report["link_bytes"])
    again: list[Any] = [None] * world
    td.all_gather_object(again, {"busbw": busbw, "links": pairs})
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


def gbps(value: float) -> str:
    """`0.9 GB/s`, `11.8 GB/s`, `1,000 GB/s`: three significant digits, never an exponent above 1."""
    number = value / GB
    return f"{number:,.0f} GB/s" if number >= 1000 else f"{number:.3g} GB/s"


def judge(report: dict[str, Any], cfg: PreflightConfig) -> dict[str, Any]:
    """The problems (each naming its rank or link) and the warnings; `ok` when there is no problem."""
    ranks, link_rows = report["ranks"], report["links"]
    problems: list[str] = []
    named: list[int] = []
    floor = cfg.floor_gb_per_second * GB if cfg.floor_gb_per_second else 0.0

    def too_slow(value: float, median: float) -> str | None:
        """None when fast enough, else what it is compared with: the median, or the floor it is under."""
        if value < floor:
            return f"under the floor {gbps(floor)}"
        return f"median {gbps(median)}" if value < cfg.min_bandwidth_fraction * median else None

    for entry in ranks:
        device = entry["device"]
        failed = [f"{name} {_device_problem(name, device[name])}" for name in ("matmul", "memory", "driver")
                  if not device[name]["ok"]]
        if failed:
            problems.append(f"{who(entry)}: device {device['device']}: {', '.join(failed)}")
            named.append(entry["rank"])
    median = statistics.median(e["all_reduce"]["busbw"] for e in ranks)
    report["median_all_reduce_busbw"] = median
    for entry in ranks:
        if against := too_slow(entry["all_reduce"]["busbw"], median):
            problems.append(f"{who(entry)}: all-reduce {gbps(entry['all_reduce']['busbw'])}, {against}")
            named.append(entry["rank"])
    problems += _slow_links(ranks, link_rows, too_slow, report, named)
    warnings = []
    offsets = [e["clock_offset_seconds"] for e in ranks]
    middle = statistics.median(offsets)
    for entry, offset in zip(ranks, offsets, strict=True):
        if abs(offset - middle) > CLOCK_SKEW_WARN_SECONDS:
            warnings.append(f"{who(entry)}: clock {offset - middle:+.1f} s off the job's median (NTP?)")
    order = list(dict.fromkeys(named))
    return {"ok": not problems, "problems": problems, "warnings": warnings, "named_ranks": order}


def _slow_links(ranks: list[dict[str, Any]], rows: list[dict[str, Any]],
                too_slow: Callable[[float, float], str | None],
                report: dict[str, Any], named: list[int]) -> list[str]:
    """A rank all of whose links (two or more) are slow is the slow one; any other slow link names both ends."""
    if not rows:
        return []
    median = statistics.median(r["bandwidth"] for r in rows)
    report["median_link_bandwidth"] = median
    slow = [r for r in rows if too_slow(r["bandwidth"], median)]
    per_rank: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        for r in row["ranks"]:
            per_rank.setdefault(r, []).append(row)
    culprits = [r for r, mine in per_rank.items() if len(mine) >= 2 and all(row in slow for row in mine)]
    problems = []
    for r in culprits:
        mine = per_rank[r]
        peers = " and ".join(f"rank {next(x for x in row['ranks'] if x != r)}" for row in mine)
        worst = max(row["bandwidth"] for row in mine)
        problems.append(f"{who(ranks[r])}: send/recv {gbps(worst)} or less to {peers}, {too_slow(worst, median)}")
        named.append(r)
    for row in slow:
        a, b = row["ranks"]
        if a in culprits or b in culprits:
            continue
        problems.append(f"link {who(ranks[a])} <-> {who(ranks[b])}: send/recv {gbps(row['bandwidth'])}, "
                        f"{too_slow(row['bandwidth'], median)}")
        named += [a, b]
    return problems


def _device_problem(name: str, result: dict[str, Any]) -> str:
    if "error" in result:
        return str(result["error"])
    if name == "matmul":
        return f"off by {result['relative_error']:.2g} (tolerance {result['tolerance']:g})"
    if name == "memory":
        return f"{result.get('wrong_words', 0)} 64-bit words of {result['bytes']} bytes read back wrong"
    return (f"uncorrected ECC errors {result.get('ecc_uncorrected')}, retired pages pending "
            f"{result.get('retired_pages_pending')}")


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
        lines.append(f"preflight: ok (median all-reduce {gbps(report['median_all_reduce_busbw'])}, "
                     f"send/recv {gbps(report.get('median_link_bandwidth', float('nan')))})")
    return lines


"""The preflight's verdict on the gathered measurements: what is wrong, with whom, and how certain it is.

What the measurements can say and what they cannot:
- A device check is about one rank: a wrong matmul or an uncorrectable memory error names its rank, and is certain.
- A link's send/recv ping-pong is about its two ranks, but links differ by class: inside a node (NVLink, PCIe,
  shared memory) and across nodes (InfiniBand, Ethernet) are each other's 3x to 10x, so each link is compared with
  the median of the other links of its class (and that class's floor, when set). A rank all of whose links are slow
  is the slow one.
- The all-reduce is one figure for the job: a collective ends at about the same time on every rank, so what differs
  between ranks is when they arrived (the late rank measures the shortest time and looks best). It is compared with
  its floor and never names a rank.
A problem is certain when the two looks agree far beyond measuring noise (CERTAIN_FACTOR); `on_failure: auto` stops
a job in a pod only on certain ones.
"""

from __future__ import annotations

import bisect
import statistics
from dataclasses import dataclass, field
from typing import Any

from kubetrain.config.preflight import PreflightConfig

GB = 1e9
SAME_NODE, ACROSS_NODES = "same node", "across nodes"
CLASS_WORDS = {SAME_NODE: "within a node", ACROSS_NODES: "across nodes"}
# A link below its class's median by this factor on both looks stops a job under `auto`. A healthy link's best of
# 5 ping-pongs, the better of its two ends, scatters within 2.5x of its class's median (a healthy 4-process job on
# this project's loaded 2-core machine, a CPU hog beside it, showed one link at 0.41 of the median on both looks);
# the faults worth stopping a job for are a factor of 4 or more: an InfiniBand port trained down from 4x to 1x
# width, a 100 Gb/s NIC come up at 25, NVLink fallen back to PCIe (NVLink 4: 450 GB/s a direction, PCIe 5 x16: 64).
CERTAIN_FACTOR = 4.0
CLOCK_SKEW_WARN_SECONDS = 1.0  # the hang watch and the ETA compare wall clocks across nodes: a warning, not a stop


def gbps(value: float) -> str:
    """`0.9 GB/s`, `11.8 GB/s`, `1,000 GB/s`: three significant digits, never an exponent above 1."""
    number = value / GB
    return f"{number:,.0f} GB/s" if number >= 1000 else f"{number:.3g} GB/s"


def who(entry: dict[str, Any]) -> str:
    """`rank 5 (pod X, node Y)`, or `rank 5 (node Y)` outside Kubernetes."""
    pod = f"pod {entry['pod']}, " if entry.get("pod") else ""
    return f"rank {entry['rank']} ({pod}node {entry['node']})"


def host(entry: dict[str, Any]) -> str:
    """The host a rank's links start from: its pod (the processes one torchrun agent starts share it and its
    devices' NVLink; two pods talk over the network even on one Kubernetes node, as NCCL sees them), else its node."""
    return str(entry.get("pod") or entry["node"])


def link_class(ranks: list[dict[str, Any]], a: int, b: int) -> str:
    return SAME_NODE if host(ranks[a]) == host(ranks[b]) else ACROSS_NODES


@dataclass
class Problem:
    text: str
    ranks: list[int]
    certain: bool


@dataclass
class Findings:
    problems: list[Problem] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def verdict(self) -> dict[str, Any]:
        named = list(dict.fromkeys(r for p in self.problems for r in p.ranks))
        certain = [p for p in self.problems if p.certain]
        return {"ok": not self.problems, "problems": [p.text for p in self.problems],
                "certain": [p.text for p in certain], "warnings": self.warnings, "named_ranks": named,
                "certain_ranks": list(dict.fromkeys(r for p in certain for r in p.ranks))}


def judge(report: dict[str, Any], cfg: PreflightConfig) -> dict[str, Any]:
    """The problems (each naming its rank or link, certain or not) and the warnings; `ok` when there is no problem.

    Adds the job's figures to `report`: its all-reduce bus bandwidth and each link class's median.
    """
    ranks = report["ranks"]
    looks = 2 if report.get("second_look") else 1
    found = Findings()
    _devices(ranks, found)
    _all_reduce(report, cfg, looks, found)
    _links(report, cfg, looks, found)
    offsets = [e["clock_offset_seconds"] for e in ranks]
    middle = statistics.median(offsets)
    for entry, offset in zip(ranks, offsets, strict=True):
        if abs(offset - middle) > CLOCK_SKEW_WARN_SECONDS:
            found.warnings.append(f"{who(entry)}: clock {offset - middle:+.1f} s off the job's median (NTP?)")
    return found.verdict()


def _devices(ranks: list[dict[str, Any]], found: Findings) -> None:
    for entry in ranks:
        device = entry["device"]
        failed = [f"{name} {_device_problem(name, device[name])}" for name in ("matmul", "memory", "driver")
                  if not device[name]["ok"]]
        if failed:
            # out of memory is the allocator's word (another process holds the device), not a fault of the device
            certain = any(not device[n]["ok"] and "out of memory" not in str(device[n].get("error", ""))
                          for n in ("matmul", "memory", "driver"))
            found.problems.append(Problem(f"{who(entry)}: device {device['device']}: {', '.join(failed)}",
                                          [entry["rank"]], certain))
        for line in device["driver"].get("warnings", []):
            found.warnings.append(f"{who(entry)}: device {device['device']}: {line}")


def _all_reduce(report: dict[str, Any], cfg: PreflightConfig, looks: int, found: Findings) -> None:
    """The job's all-reduce bus bandwidth (the ranks' median) against its floor."""
    figure = statistics.median(e["all_reduce"]["busbw"] for e in report["ranks"])
    report["all_reduce_busbw"] = report["median_all_reduce_busbw"] = figure
    floor = (cfg.all_reduce_floor_gb_per_second or 0.0) * GB
    if figure < floor:
        found.problems.append(Problem(f"job: all-reduce bus bandwidth {gbps(figure)}, under the floor {gbps(floor)}",
                                      [], looks == 2))


def _links(report: dict[str, Any], cfg: PreflightConfig, looks: int, found: Findings) -> None:
    """Each link against its class's median and floor; a rank all of whose links (two or more) are slow is named
    alone, any other slow link names both ends."""
    ranks, rows = report["ranks"], report["links"]
    if not rows:
        return
    floors = {SAME_NODE: cfg.same_node_floor_gb_per_second, ACROSS_NODES: cfg.across_nodes_floor_gb_per_second}
    by_class: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        row["class"] = link_class(ranks, *row["ranks"])
        by_class.setdefault(row["class"], []).append(row)
    medians = {kind: statistics.median(r["bandwidth"] for r in mine) for kind, mine in by_class.items()}
    report["link_classes"] = {kind: {"links": len(by_class[kind]), "median": medians[kind],
                                     "floor": (floors[kind] or 0.0) * GB or None} for kind in by_class}
    report["median_link_bandwidth"] = statistics.median(r["bandwidth"] for r in rows)

    ordered = {kind: sorted(r["bandwidth"] for r in mine) for kind, mine in by_class.items()}

    def against(row: dict[str, Any]) -> tuple[str, bool] | None:
        """None when fast enough, else (what it is compared with, certain)."""
        kind, value = row["class"], row["bandwidth"]
        floor = (floors[kind] or 0.0) * GB
        if value < floor:
            return f"under the floor {CLASS_WORDS[kind]} {gbps(floor)}", looks == 2
        median = _others_median(ordered[kind], value)
        if median is not None and value < cfg.min_bandwidth_fraction * median:
            return f"median {CLASS_WORDS[kind]} {gbps(median)}", looks == 2 and value * CERTAIN_FACTOR < median
        return None

    slow = {tuple(r["ranks"]): verdict for r in rows if (verdict := against(r)) is not None}
    per_rank: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        for r in row["ranks"]:
            per_rank.setdefault(r, []).append(row)
    culprits = [r for r, mine in per_rank.items() if len(mine) >= 2 and all(tuple(x["ranks"]) in slow for x in mine)]
    for r in culprits:
        mine = per_rank[r]
        peers = " and ".join(f"rank {next(x for x in row['ranks'] if x != r)}" for row in mine)
        worst = max(mine, key=lambda row: row["bandwidth"])
        text, _ = slow[tuple(worst["ranks"])]
        found.problems.append(Problem(f"{who(ranks[r])}: send/recv {gbps(worst['bandwidth'])} or less to {peers}, "
                                      f"{text}", [r], all(slow[tuple(x["ranks"])][1] for x in mine)))
    for row in rows:
        a, b = row["ranks"]
        if (a, b) not in slow or a in culprits or b in culprits:
            continue
        text, certain = slow[(a, b)]
        found.problems.append(Problem(f"link {who(ranks[a])} <-> {who(ranks[b])}: send/recv "
                                      f"{gbps(row['bandwidth'])}, {text}", [a, b], certain))


def _others_median(values: list[float], value: float) -> float | None:
    """The median of a class's other links (`values` sorted, `value` one of them): in a class of two, one slow link
    would otherwise drag the median it is compared with halfway down to itself."""
    i, m = bisect.bisect_left(values, value), len(values) - 1
    if m < 1:
        return None

    def kth(k: int) -> float:  # the k-th of the others, without copying them
        return values[k] if k < i else values[k + 1]

    return kth(m // 2) if m % 2 else (kth(m // 2 - 1) + kth(m // 2)) / 2


def _device_problem(name: str, result: dict[str, Any]) -> str:
    if "error" in result:
        return str(result["error"])
    if name == "matmul":
        return f"off by {result['relative_error']:.2g} (tolerance {result['tolerance']:g})"
    if name == "memory":
        return f"{result.get('wrong_words', 0)} 64-bit words of {result['bytes']} bytes read back wrong"
    return "; ".join(result.get("problems", [])) or "failed"


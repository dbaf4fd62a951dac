"""The preflight's verdict on the topologies users run, through the real judge with synthetic measurements: a healthy
job never fails (8 GPUs a node over NVLink, nodes over InfiniBand, 64x8, with +-30% noise), and one slow link or one
bad device is named rightly, certain only when far beyond noise on two looks. Seeded random loops (hypothesis is
not installed here)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kubetrain.config.preflight import PreflightConfig
from kubetrain.distributed.device_check import judge_driver
from kubetrain.distributed.links import neighbour_links
from kubetrain.distributed.preflight import judge

GB = 1e9
NVLINK, INFINIBAND = 150 * GB, 45 * GB  # send/recv within a node and across nodes on an 8-GPU node
SEEDS = range(25)


def job(nodes: int, per_node: int, rng: random.Random, *, noise: float = 0.3, second_look: bool = True,
        links: dict[tuple[int, int], float] | None = None, bad_device: dict[int, dict[str, Any]] | None = None,
        ) -> dict[str, Any]:
    """A gathered table as measure() builds it: rank r on node r // per_node (its pod too), each ring link at its
    class's speed times noise, each rank's all-reduce figure scattered by arrival skew (0.3x to 3x)."""
    world = nodes * per_node
    ranks = []
    for rank in range(world):
        device: dict[str, Any] = {"device": f"cuda:{rank % per_node}", "ok": True, "memory": {"ok": True},
                                  "driver": judge_driver({}),
                                  "matmul": {"ok": True, "relative_error": 1e-4, "tolerance": 1e-2}}
        device.update((bad_device or {}).get(rank, {}))
        ranks.append({"rank": rank, "pod": f"job-{rank // per_node}", "node": f"gpu-{rank // per_node}",
                      "device": device, "all_reduce": {"busbw": 100 * GB * rng.uniform(0.3, 3.0),
                                                       "latency_seconds": 3e-5},
                      "clock_offset_seconds": rng.uniform(-0.05, 0.05)})
    rows = []
    for a, b in neighbour_links(world):
        low, high = min(a, b), max(a, b)
        base = NVLINK if low // per_node == high // per_node else INFINIBAND
        bandwidth = (links or {}).get((low, high), base) * rng.uniform(1 - noise, 1 + noise)
        rows.append({"ranks": [low, high], "bandwidth": bandwidth})
    for row in rows:
        a, b = row["ranks"]
        ranks[a].setdefault("links", []).append((b, row["bandwidth"]))
        ranks[b].setdefault("links", []).append((a, row["bandwidth"]))
    return {"ranks": ranks, "links": sorted(rows, key=lambda r: r["ranks"]), "second_look": second_look}


@pytest.mark.parametrize(("nodes", "per_node"), [(1, 8), (2, 8), (8, 1), (64, 8)])
@pytest.mark.parametrize("second_look", [False, True])
def test_a_healthy_job_of_the_shapes_users_run_never_fails(nodes: int, per_node: int, second_look: bool) -> None:
    for seed in SEEDS:
        verdict = judge(job(nodes, per_node, random.Random(seed), second_look=second_look), PreflightConfig())
        assert verdict["ok"], (seed, verdict["problems"][:3])
        assert verdict["problems"] == [] and verdict["named_ranks"] == []


def test_the_all_reduce_names_no_rank_the_late_rank_looks_best() -> None:
    """A collective ends together: rank 1 started 30 ms late measured 1.064 GB/s, rank 0 0.378 (arrival skew)."""
    report = job(1, 2, random.Random(0))
    report["ranks"][0]["all_reduce"]["busbw"], report["ranks"][1]["all_reduce"]["busbw"] = 0.378 * GB, 1.064 * GB
    verdict = judge(report, PreflightConfig())
    assert verdict["ok"] and report["all_reduce_busbw"] == pytest.approx((0.378 + 1.064) / 2 * GB)


def test_the_job_all_reduce_under_its_floor_is_a_job_problem_naming_no_rank() -> None:
    report = job(2, 8, random.Random(1))
    for entry in report["ranks"]:
        entry["all_reduce"]["busbw"] = 20 * GB
    verdict = judge(report, PreflightConfig(all_reduce_floor_gb_per_second=40))
    assert verdict["problems"] == ["job: all-reduce bus bandwidth 20 GB/s, under the floor 40 GB/s"]
    assert verdict["named_ranks"] == [] and verdict["certain"] == verdict["problems"]  # two looks agreed


def test_one_slow_link_across_nodes_is_named_with_its_two_ranks_and_certain_when_far_below() -> None:
    for seed in SEEDS:
        for nodes, slow in ((2, (7, 8)), (64, (255, 256))):  # the ring crosses nodes between r=8k-1 and 8k
            verdict = judge(job(nodes, 8, random.Random(seed), links={slow: INFINIBAND / 10}), PreflightConfig())
            a, b = slow
            assert verdict["named_ranks"] == [a, b], (seed, verdict["problems"])
            [problem] = verdict["problems"]
            assert problem.startswith(f"link rank {a} (pod job-{a // 8}, node gpu-{a // 8}) <-> rank {b} "
                                      f"(pod job-{b // 8}, node gpu-{b // 8}): send/recv ")
            assert "median across nodes" in problem
            assert verdict["certain"] == [problem]


def test_one_slow_link_within_a_node_is_named_against_its_class_not_the_network() -> None:
    for seed in SEEDS:
        # 30 GB/s: faster than every link across nodes, a fifth of NVLink
        verdict = judge(job(2, 8, random.Random(seed), links={(3, 4): 30 * GB}), PreflightConfig())
        assert verdict["named_ranks"] == [3, 4], (seed, verdict["problems"])
        assert "median within a node" in verdict["problems"][0]


def test_a_link_named_below_half_but_within_the_certain_factor_warns_under_auto() -> None:
    for seed in SEEDS:
        verdict = judge(job(64, 8, random.Random(seed), noise=0.05, links={(255, 256): INFINIBAND / 2.5}),
                        PreflightConfig())
        assert verdict["named_ranks"] == [255, 256] and verdict["certain"] == [], (seed, verdict)
    one_look = judge(job(64, 8, random.Random(0), second_look=False, links={(255, 256): INFINIBAND / 10}),
                     PreflightConfig())
    assert one_look["named_ranks"] == [255, 256] and one_look["certain"] == []  # a single look is never certain


def test_a_rank_whose_links_are_all_slow_is_the_one_named() -> None:
    verdict = judge(job(2, 8, random.Random(3), links={(4, 5): 10 * GB, (5, 6): 12 * GB}), PreflightConfig())
    assert verdict["named_ranks"] == [5]
    assert verdict["problems"][0].startswith("rank 5 (pod job-0, node gpu-0): send/recv ")


def test_a_class_floor_names_a_link_whatever_its_class_median() -> None:
    cfg = PreflightConfig(across_nodes_floor_gb_per_second=50)  # InfiniBand at 45 on every cross link
    verdict = judge(job(2, 8, random.Random(4), noise=0.0), cfg)
    assert sorted(verdict["named_ranks"]) == [0, 7, 8, 15]
    assert all("under the floor across nodes 50 GB/s" in p for p in verdict["problems"])


def test_one_bad_device_is_named_and_certain() -> None:
    wrong = {"ok": False, "matmul": {"ok": False, "relative_error": 0.3, "tolerance": 1e-2}}
    ecc = {"ok": False, "driver": judge_driver({"ecc_volatile_uncorrected": 2})}
    for seed in SEEDS:
        verdict = judge(job(64, 8, random.Random(seed), bad_device={77: wrong, 300: ecc}), PreflightConfig())
        assert verdict["named_ranks"] == [77, 300] == verdict["certain_ranks"], verdict["problems"]
        assert verdict["problems"] == [
            "rank 77 (pod job-9, node gpu-9): device cuda:5: matmul off by 0.3 (tolerance 0.01)",
            "rank 300 (pod job-37, node gpu-37): device cuda:4: driver 2 uncorrectable ECC error(s) since the "
            "driver loaded"]


def test_a_device_out_of_memory_is_named_but_not_certain() -> None:
    full = {"ok": False, "memory": {"ok": False, "bytes": 2**30, "error": "out of memory: CUDA out of memory"}}
    verdict = judge(job(1, 8, random.Random(0), bad_device={2: full}), PreflightConfig())
    assert verdict["named_ranks"] == [2] and verdict["certain"] == []

"""The preflight: its verdict names the rank (pod, node) whose device or links fail; `--nproc 4` over gloo runs it
for real before step 1 (table, preflight.json, metrics, runs show/compare), and a device that computes wrong on
one rank stops the job with that rank named."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kubetrain.config.preflight import PreflightConfig
from kubetrain.config.schema import Config
from kubetrain.distributed.links import bus_bandwidth
from kubetrain.distributed.preflight import POD_NAME_ENV, judge, stops
from kubetrain.errors import EXIT_PREFLIGHT
from kubetrain.runs.layout import PREFLIGHT_FILE
from kubetrain.track.prometheus import PrometheusSink
from tests.conftest import SRC, TINY, cli_env

GB = 1e9


def report(busbw: list[float], links: dict[tuple[int, int], float], *, matmul_error: dict[int, float] | None = None,
           offsets: dict[int, float] | None = None) -> dict[str, Any]:
    """A gathered table as measure() builds it, with the values a test names."""
    ranks = []
    for rank, value in enumerate(busbw):
        error = (matmul_error or {}).get(rank, 1e-7)
        ranks.append({
            "rank": rank, "pod": f"job-{rank}", "node": f"node-{rank}",
            "device": {"device": "cpu", "ok": error <= 1e-4, "driver": {"ok": True}, "memory": {"ok": True},
                       "matmul": {"ok": error <= 1e-4, "relative_error": error, "tolerance": 1e-4}},
            "all_reduce": {"busbw": value, "latency_seconds": 1e-4},
            "links": sorted((b if a == rank else a, bw) for (a, b), bw in links.items() if rank in (a, b)),
            "clock_offset_seconds": (offsets or {}).get(rank, 0.0),
        })
    return {"ranks": ranks, "links": [{"ranks": list(k), "bandwidth": v} for k, v in sorted(links.items())]}


Links = dict[tuple[int, int], float]


def ring(world: int, bandwidth: float, slow: Links | None = None) -> Links:
    links = {(min(r, (r + 1) % world), max(r, (r + 1) % world)): bandwidth for r in range(world)}
    return {**links, **(slow or {})}


def test_a_rank_with_a_slow_all_reduce_is_not_named_the_all_reduce_is_the_jobs() -> None:
    busbw = [11.8 * GB] * 8
    busbw[5] = 0.9 * GB  # a collective ends together: this is when rank 5 arrived, not how fast it is
    verdict = judge(report(busbw, ring(8, 20 * GB)), PreflightConfig())
    assert verdict["ok"] and verdict["named_ranks"] == []


def test_a_rank_whose_two_links_are_slow_is_the_one_named_not_its_neighbours() -> None:
    links = ring(4, 2 * GB, {(2, 3): 0.01 * GB, (0, 3): 0.012 * GB})
    verdict = judge(report([1 * GB] * 4, links), PreflightConfig())
    assert verdict["named_ranks"] == [3]
    assert verdict["problems"][0].startswith("rank 3 (pod job-3, node node-3): send/recv 0.012 GB/s or less to ")


def test_one_slow_link_names_both_of_its_ranks() -> None:
    verdict = judge(report([1 * GB] * 4, ring(4, 2 * GB, {(1, 2): 0.1 * GB})), PreflightConfig())
    assert verdict["named_ranks"] == [1, 2]
    assert verdict["problems"] == ["link rank 1 (pod job-1, node node-1) <-> rank 2 (pod job-2, node node-2): "
                                   "send/recv 0.1 GB/s, median across nodes 2 GB/s"]


def test_the_floors_name_links_and_the_job_even_when_all_are_equally_slow() -> None:
    cfg = PreflightConfig(across_nodes_floor_gb_per_second=5, all_reduce_floor_gb_per_second=3)
    verdict = judge(report([1 * GB] * 2, ring(2, 2 * GB)), cfg)
    assert verdict["named_ranks"] == [0, 1]
    assert verdict["problems"] == ["job: all-reduce bus bandwidth 1 GB/s, under the floor 3 GB/s",
                                   "link rank 0 (pod job-0, node node-0) <-> rank 1 (pod job-1, node node-1): "
                                   "send/recv 2 GB/s, under the floor across nodes 5 GB/s"]
    assert judge(report([1 * GB] * 2, ring(2, 2 * GB)), PreflightConfig())["ok"]  # no floor: equal ranks pass


def test_a_device_that_computes_wrong_is_named() -> None:
    verdict = judge(report([1 * GB] * 4, ring(4, 2 * GB), matmul_error={1: 0.3}), PreflightConfig())
    assert verdict["problems"] == ["rank 1 (pod job-1, node node-1): device cpu: matmul off by 0.3 (tolerance 0.0001)"]


def test_a_skewed_clock_is_a_warning_not_a_failure() -> None:
    verdict = judge(report([1 * GB] * 4, ring(4, 2 * GB), offsets={2: 7.5}), PreflightConfig())
    assert verdict["ok"] and verdict["warnings"] == [
        "rank 2 (pod job-2, node node-2): clock +7.5 s off the job's median (NTP?)"]


def test_auto_stops_in_a_rendered_pod_and_warns_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(POD_NAME_ENV, raising=False)
    assert not stops(PreflightConfig()) and stops(PreflightConfig(on_failure="stop"))
    monkeypatch.setenv(POD_NAME_ENV, "job-0")
    assert stops(PreflightConfig()) and not stops(PreflightConfig(on_failure="warn"))


def test_dist_preflight_false_turns_it_off_and_a_mapping_sets_it() -> None:
    assert not Config.model_validate({"dist": {"preflight": False}}).dist.preflight.enabled
    assert Config.model_validate({"dist": {"preflight": {"budget_seconds": 5}}}).dist.preflight.budget_seconds == 5
    assert Config().dist.preflight.enabled and Config().dist.preflight.budget_seconds < 60


def _train(tmp_path: Path, *sets: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    args = [a for s in [*TINY, "train.max_steps=2", f"run.output_dir={tmp_path}", *sets] for a in ("--set", s)]
    command = [sys.executable, "-m", "kubetrain", "train", *args, "--nproc", "4", "--oversubscribe"]  # 2 cores here
    return subprocess.run(command, cwd=tmp_path, env=env or cli_env(), capture_output=True, text=True, timeout=600)


def _scrape(run: Path) -> dict[str, dict[str, float]]:
    sink = PrometheusSink(0, "127.0.0.1", stream=io.StringIO())
    sink.start({"run": "unit", "run_dir": str(run)})
    try:
        from prometheus_client import generate_latest

        text = generate_latest(sink.registry).decode()
    finally:
        sink.finish("finished")
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[s.labels.get("rank", "")] = s.value
    return out


@pytest.mark.slow
@pytest.mark.ci  # a heavy end-to-end proof (many processes): .ci/run runs it, not the README's test command
def test_a_healthy_four_process_job_prints_its_table_before_step_1_and_keeps_it(tmp_path: Path) -> None:
    proc = _train(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    head = out.index("[rank 0] preflight: 4 ranks over gloo in ")
    assert head < out.index("[rank 0] model:") < out.index("step 2/2")  # before the model is built
    assert "[rank 0] preflight: ok (job all-reduce " in out
    run = next(tmp_path.rglob(PREFLIGHT_FILE)).parent
    table = json.loads((run / PREFLIGHT_FILE).read_text())
    assert table["verdict"] == {"ok": True, "problems": [], "certain": [], "warnings": [], "named_ranks": [],
                                "certain_ranks": []}
    assert table["seconds"] <= table["budget_seconds"] and table["world_size"] == 4
    for entry in table["ranks"]:
        rows = entry["all_reduce"]["sizes"]
        assert all(r["busbw"] == pytest.approx(bus_bandwidth(r["bytes"], r["seconds"], 4)) for r in rows)
        assert entry["all_reduce"]["busbw"] == max(r["busbw"] for r in rows)
        assert sorted(peer for peer, _ in entry["links"]) == sorted({(entry["rank"] + 1) % 4, (entry["rank"] - 1) % 4})
    metrics = _scrape(run)
    assert metrics["kubetrain_preflight_ok"] == {"": 1.0}
    assert metrics["kubetrain_preflight_all_reduce_bus_bytes_per_second"] == {
        str(e["rank"]): pytest.approx(e["all_reduce"]["busbw"]) for e in table["ranks"]}
    shown = subprocess.run([sys.executable, "-m", "kubetrain", "runs", "show", str(run)], env=cli_env(),
                           capture_output=True, text=True, timeout=120)
    assert f"preflight: ok in {table['seconds']:.1f} s over 4 ranks" in shown.stdout
    compared = subprocess.run([sys.executable, "-m", "kubetrain", "runs", "compare", str(run), "--json"],
                              env=cli_env(), capture_output=True, text=True, timeout=120)
    summary = json.loads(compared.stdout)["runs"][0]["preflight"]
    assert summary["ok"] and summary["all_reduce_busbw"] == pytest.approx(table["median_all_reduce_busbw"])


# Started by the test only: on rank 2 (a torchrun worker), the device's matmul gets one wrong element.
CORRUPT_RANK_2 = '''
import os
if os.environ.get("RANK") == "2" and os.environ.get("TORCHELASTIC_RUN_ID"):
    import kubetrain.distributed.device_check as check
    right = check.device_matmul
    def wrong(a, b):
        out = right(a, b)
        out[7, 7] += out.abs().max()
        return out
    check.device_matmul = wrong
'''


def _train_with_hook(tmp_path: Path, hook_source: str) -> subprocess.CompletedProcess[str]:
    """`--nproc 4` with `on_failure: stop`, every process starting `hook_source` first (a test-only sitecustomize)."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(hook_source)
    env = cli_env(PYTHONPATH=os.pathsep.join([str(hook), str(SRC)]))
    return _train(tmp_path, "dist.preflight.on_failure=stop", env=env)


@pytest.mark.ci  # minutes of processes together with its peers: .ci/run runs it, not the README's test command
@pytest.mark.slow
def test_a_device_that_computes_wrong_stops_the_job_before_training_naming_its_rank(tmp_path: Path) -> None:
    proc = _train_with_hook(tmp_path, CORRUPT_RANK_2)
    assert proc.returncode == EXIT_PREFLIGHT, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    host = os.uname().nodename
    assert last.startswith(f"error: preflight: rank 2 (node {host}): device cpu: matmul off by "), last
    assert "rank 0 (" not in last and "rank 1 (" not in last and "rank 3 (" not in last
    assert "model:" not in proc.stdout + proc.stderr  # stopped before the model was built
    incidents = [json.loads(f.read_text()) for f in tmp_path.rglob("incidents/*.json")]
    assert ("preflight", 2) in [(i["kind"], i["rank"]) for i in incidents]


# Started by the test only: rank 2 stalls 0.2 s in every ping-pong of its first link sweep (a busy host), not after.
STALL_RANK_2_ONCE = '''
import os
if os.environ.get("RANK") == "2" and os.environ.get("TORCHELASTIC_RUN_ID"):
    import time
    import kubetrain.distributed.links as links
    sweep, timed, calls = links.link_sweep, links._best_time, []

    def stalled(op, device, iterations):
        def late():
            time.sleep(0.2)
            op()
        return timed(late, device, iterations)

    def first_stalls(*args, **kwargs):
        calls.append(args)
        links._best_time = stalled if len(calls) == 1 else timed
        try:
            return sweep(*args, **kwargs)
        finally:
            links._best_time = timed

    links.link_sweep = first_stalls
'''


@pytest.mark.ci  # minutes of processes together with its peers: .ci/run runs it, not the README's test command
@pytest.mark.slow
def test_a_rank_stalled_once_is_cleared_by_the_second_look_and_the_job_trains(tmp_path: Path) -> None:
    proc = _train_with_hook(tmp_path, STALL_RANK_2_ONCE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = json.loads(next(tmp_path.rglob(PREFLIGHT_FILE)).read_text())
    assert table["second_look"] is True and table["verdict"]["ok"]  # the first look had named rank 2's links
    assert table["seconds"] <= table["budget_seconds"]


# Started by the test only: rank 2 is killed (SIGKILL: no word, no error file) in its device check.
KILL_RANK_2 = '''
import os
if os.environ.get("RANK") == "2" and os.environ.get("TORCHELASTIC_RUN_ID"):
    import signal
    import kubetrain.distributed.device_check as check

    def killed(a, b):
        os.kill(os.getpid(), signal.SIGKILL)

    check.device_matmul = killed
'''


@pytest.mark.ci  # minutes of processes together with its peers: .ci/run runs it, not the README's test command
@pytest.mark.slow
def test_a_worker_killed_during_the_preflight_is_an_incident_naming_its_rank(tmp_path: Path) -> None:
    """A kill at step 3 was named by the hang watch from the heartbeats; in the preflight there are none yet, and the
    job ended with no incident: the agent's failure names the rank, so the launcher records it."""
    proc = _train_with_hook(tmp_path, KILL_RANK_2)
    assert proc.returncode != 0, proc.stderr[-3000:]
    incidents = [json.loads(f.read_text()) for f in tmp_path.rglob("incidents/*.json")]
    assert [(i["rank"], i["step"]) for i in incidents if i["kind"] in ("worker-exit", "oom")] == [(2, None)], incidents
    assert "incident: " in proc.stderr and "rank 2" in proc.stderr

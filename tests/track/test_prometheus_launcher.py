"""The launcher's /metrics: its ranks' heartbeats, incidents, a failure its last scrape sees, and rank 0's gauges
from whichever node holds global rank 0."""

from __future__ import annotations

import io
import json
import os
import socket
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kubetrain.track.prometheus_launcher import LauncherExporter, RankBeat
from tests.train.conftest import children, lines_in, rank_of, sets, start, wait_until


def scrape(port: int) -> dict[str, dict[frozenset[tuple[str, str]], float]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, dict[frozenset[tuple[str, str]], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[frozenset(sample.labels.items())] = sample.value
    return out


def _failed_as_the_last_scrape_sees(exporter: LauncherExporter) -> list[float]:
    """`kubetrain_job_failed` as a Prometheus that comes back after the launcher gave up reads it: close waits for
    that scrape, then stops serving."""
    seen: list[float] = []

    def scraper() -> None:
        while exporter.failed_at is None:
            time.sleep(0.01)
        seen.extend(scrape(exporter.port)["kubetrain_job_failed"].values())

    thread = threading.Thread(target=scraper)
    thread.start()
    exporter.close(failed=True)
    thread.join()
    return seen


def test_heartbeats_incidents_and_a_failure_the_last_scrape_sees() -> None:
    beats = [RankBeat(0, 12, 1000.0), RankBeat(1, 11, 999.0)]
    exporter = LauncherExporter(0, "127.0.0.1", "gpt", 4.0, lambda: beats, lambda: 2).start(stream=io.StringIO())
    exporter.incident({"kind": "hang", "rank": 1})
    exporter.incident({"kind": "hang", "rank": 1})
    m = scrape(exporter.port)
    beat = {dict(k)["rank"]: v for k, v in m["kubetrain_rank_heartbeat_timestamp_seconds"].items()}
    assert beat == {"0": 1000.0, "1": 999.0}
    assert m["kubetrain_incidents_total"] == {frozenset({"run": "gpt", "kind": "hang", "rank": "1"}.items()): 2}
    assert list(m["kubetrain_hang_alert_seconds"].values()) == [4.0]
    assert list(m["kubetrain_worker_restarts"].values()) == [2]
    assert list(m["kubetrain_job_failed"].values()) == [0]
    assert _failed_as_the_last_scrape_sees(exporter) == [1.0]  # close waited for it (it was scraped before)
    with pytest.raises(OSError):
        scrape(exporter.port)


def test_a_launcher_stopped_by_a_signal_says_so_to_its_last_scrape() -> None:
    """A planned stop (SIGTERM: `k8s stop`, a preemption) must not end the series like a kill -9, or
    KubetrainLauncherGone fires on every one: the launcher says it was stopped, as it says failed or finished."""
    exporter = LauncherExporter(0, "127.0.0.1", "gpt", 4.0, lambda: [], lambda: 0).start(stream=io.StringIO())
    assert list(scrape(exporter.port)["kubetrain_job_stopped"].values()) == [0]
    seen: list[float] = []

    def scraper() -> None:
        while exporter.stopped_at is None:
            time.sleep(0.01)
        m = scrape(exporter.port)
        seen.extend([*m["kubetrain_job_stopped"].values(), *m["kubetrain_job_failed"].values(),
                     *m["kubetrain_job_finished"].values()])

    thread = threading.Thread(target=scraper)
    thread.start()
    exporter.close(failed=False, stopped=True)  # waits for that scrape: it was scraped before
    thread.join()
    assert seen == [1.0, 0.0, 0.0]


def test_a_scrape_answered_but_not_yet_recorded_still_waits_for_the_goodbye() -> None:
    # Seen under load: the scraper had its reply before the handler thread recorded the scrape, the launcher gave
    # up at once, found no scrape recorded, and closed before the last scrape (connection reset).
    exporter = LauncherExporter(0, "127.0.0.1", "gpt", 4.0, lambda: [], lambda: 0).start(stream=io.StringIO())
    exporter.scraper_seen = True  # a scrape began and was answered; its record is still to be made
    assert _failed_as_the_last_scrape_sees(exporter) == [1.0]


def _ports() -> int:
    """A port P with P + 1 free (rank 0's exporter and its launcher's)."""
    while True:
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            try:
                b.bind(("127.0.0.1", a.getsockname()[1] + 1))
            except OSError:
                continue
            return int(a.getsockname()[1])


@pytest.mark.slow
@pytest.mark.ci  # a heavy end-to-end proof (many processes): .ci/run runs it, not the README's test command
def test_rank_0s_gauges_come_from_the_launcher_of_the_node_that_holds_it(tmp_path: Path) -> None:
    """Node rank 1 starts first, so c10d may give it global rank 0: whichever node holds it, its
    launcher passes rank 0's gauges on, and each launcher serves its own ranks' heartbeats."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{s.getsockname()[1]}"
    ports = {1: _ports(), 0: _ports()}
    nodes = {}
    for node in (1, 0):  # reversed
        nodes[node] = start("train", *sets("run.name=nodes", "train.max_steps=100000",
                                           "checkpoint.every_steps=100000", "eval.every_steps=100000",
                                           "track.prometheus.enabled=true", "track.prometheus.host=127.0.0.1",
                                           f"track.prometheus.port={ports[node]}"),
                            "--nnodes", "2", "--nproc", "1", "--rdzv-endpoint", endpoint, "--rdzv-id", "order",
                            "--node-rank", str(node), cwd=tmp_path)
        time.sleep(1.0)  # let node 1's agent reach the rendezvous first (the order is the point, not a timing)
    try:
        wait_until(lambda: lines_in(tmp_path / "runs" / "nodes" / "metrics.jsonl") >= 3, nodes[0])
        holder = next(n for n, proc in nodes.items() if any(rank_of(pid) == 0 for pid in children(proc.pid)))
        print(f"global rank 0 runs on node rank {holder}")
        for node in (0, 1):
            m = scrape(ports[node] + 1)
            ranks = {dict(k)["rank"] for k in m["kubetrain_rank_heartbeat_timestamp_seconds"]}
            assert ranks == ({"0"} if node == holder else {"1"})
            assert ("kubetrain_step" in m) == (node == holder), sorted(m)
    finally:
        for proc in nodes.values():
            proc.kill()
            proc.communicate()


def _beat(folder: Path, rank: int, step: int, at: float, restart: int = 0, done: bool = False) -> None:
    """A heartbeat file as a worker leaves it (train/heartbeat.py's record)."""
    record = {"rank": rank, "pid": os.getpid(), "step": step, "time": at, "restart": restart, "done": done,
              "round": f"127.0.0.1:{29500 + restart}", "started": float(restart)}
    (folder / f"rank-{rank:05d}.json").write_text(json.dumps(record))


def test_healthz_judges_the_workers_heartbeats_by_the_liveness_clock(tmp_path: Path) -> None:
    """The launcher answers the probe for its workers, over HTTP as the kubelet asks: 200 until no rank finished a
    step for the liveness clock, 503 after; while a round has no step yet (starting, restarting) only the start-up
    collective timeout applies."""
    from kubetrain.config import load_config
    from kubetrain.config.clocks import derive
    from kubetrain.k8s.simulate.kubelet import http_probe
    from kubetrain.launch.watch import HangWatch, launcher_metrics

    liveness = derive(load_config(None, "tiny", ["dist.hang_timeout_seconds=8"])).liveness
    watch = HangWatch(tmp_path, tmp_path / "run", hang_timeout=8.0)
    said: list[str] = []
    exporter = launcher_metrics(watch, 0, "127.0.0.1", 4.0, said.append, liveness)
    assert exporter is not None
    try:
        assert http_probe("127.0.0.1", exporter.port, "/healthz", 1)[0]  # starting: no heartbeat yet
        now = time.time()
        _beat(tmp_path, 0, 7, now - liveness + 5)  # rank 0 frozen a while ago, rank 1 still within the clock
        _beat(tmp_path, 1, 8, now - liveness + 5)
        ok, detail = http_probe("127.0.0.1", exporter.port, "/healthz", 1)
        assert ok and "200" in detail and '"status": "ok"' in detail
        _beat(tmp_path, 1, 8, now - liveness - 1)
        _beat(tmp_path, 0, 7, now - liveness - 2)
        ok, detail = http_probe("127.0.0.1", exporter.port, "/healthz", 1)
        assert not ok and "statuscode: 503" in detail and '"status": "stale"' in detail
        assert json.loads(detail.split(": ", 2)[2])["ranks"]["0"]["step"] == 7
        watch.handled.add("127.0.0.1:29500")  # the watch ended that round (a hang): restarting, no step yet in round 1
        assert http_probe("127.0.0.1", exporter.port, "/healthz", 1)[0]
        _beat(tmp_path, 0, 9, time.time(), restart=1)
        assert http_probe("127.0.0.1", exporter.port, "/healthz", 1)[0]
        _beat(tmp_path, 0, 20, now - liveness - 10, restart=1, done=True)  # finished ranks are not judged
        _beat(tmp_path, 1, 20, now - liveness - 10, restart=1, done=True)
        assert http_probe("127.0.0.1", exporter.port, "/healthz", 1)[0]
    finally:
        exporter.close(failed=False)

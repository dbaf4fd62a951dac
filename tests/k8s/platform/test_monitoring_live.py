"""The alert rules against a real Prometheus server scraping live exporters: rules that only parse can still never fire.

Prometheus (Debian's `prometheus`, where promtool comes from) runs on loopback with a temporary config that
scrapes and evaluates every second, loads the rules `k8s platform render` ships, and is asked for its alerts
over its HTTP API. Only the durations are scaled: the hang alert's threshold comes from the job's own clock
(`dist.hang_timeout_seconds=8` -> 4 s), the straggler rule's `for:` (minutes) is cut to 0s here, and the
launcher-gone rule's (four scrapes) to four of these scrapes.
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubetrain.errors import EXIT_FAILURE
from kubetrain.k8s.platform.config import AlertsConfig
from kubetrain.k8s.platform.monitoring import rule_groups
from kubetrain.runs.incidents import read_all
from kubetrain.track.prometheus import PrometheusSink
from kubetrain.train.straggler import Stragglers
from tests.k8s.platform.conftest import tool
from tests.train.conftest import children, lines_in, rank_of, sets, start, wait_until

SAFETY = 240.0  # a net against a hang of the test itself, never a timing assertion


def two_free_ports() -> int:
    """A port P with P + 1 free as well (rank 0's exporter and its launcher's)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return int(port)
    raise RuntimeError("no two adjacent free ports")


class Prometheus:
    def __init__(self, binary: str, folder: Path, targets: list[str]) -> None:
        groups = rule_groups(AlertsConfig())
        for rule in groups[0]["rules"]:
            if rule["alert"] == "KubetrainStraggler":
                rule["for"] = "0s"
            if rule["alert"] == "KubetrainLauncherGone":  # 2m at 30 s scrapes: four scrapes; here scraped each 1 s
                rule["for"] = "4s"
        (folder / "rules.yml").write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
        (folder / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": ["rules.yml"],
            "scrape_configs": [{"job_name": "kubetrain", "static_configs": [{"targets": targets}]}],
        }))
        self.port = two_free_ports()
        self.log = open(folder / "prometheus.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [binary, f"--config.file={folder / 'prometheus.yml'}", f"--storage.tsdb.path={folder / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + SAFETY
        while not self._ready():
            assert self.proc.poll() is None and time.monotonic() < deadline, (folder / "prometheus.log").read_text()
            time.sleep(0.2)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def alerts(self) -> list[dict[str, Any]]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/api/v1/alerts", timeout=5) as r:
            return list(json.loads(r.read())["data"]["alerts"])

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result, evaluated now (a series seen within the last 5 minutes counts)."""
        url = f"http://127.0.0.1:{self.port}/api/v1/query?query={urllib.parse.quote(expr)}"
        with urllib.request.urlopen(url, timeout=5) as r:
            return list(json.loads(r.read())["data"]["result"])

    def firing(self, name: str) -> list[dict[str, Any]]:
        return [a for a in self.alerts() if a["labels"]["alertname"] == name and a["state"] == "firing"]

    def wait_firing(self, name: str, ok: Callable[[], bool] = lambda: True) -> list[dict[str, Any]]:
        deadline = time.monotonic() + SAFETY
        while not (found := self.firing(name)):
            assert ok() and time.monotonic() < deadline, f"{name} never fired: {self.alerts()}"
            time.sleep(0.2)
        return found

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


@pytest.fixture
def prometheus_binary() -> str:
    return tool("prometheus", "apt-get install prometheus; scripts/test does")


@pytest.fixture
def prometheus(prometheus_binary: str, tmp_path: Path) -> Iterator[Callable[[list[str]], Prometheus]]:
    started: list[Prometheus] = []

    def start_server(targets: list[str]) -> Prometheus:
        folder = tmp_path / "prometheus"
        folder.mkdir()
        started.append(Prometheus(prometheus_binary, folder, targets))
        return started[-1]

    yield start_server
    for server in started:
        server.stop()


def _when(alert: dict[str, Any]) -> float:
    """An alert's activeAt (RFC 3339 with nanoseconds) as Unix time."""
    from datetime import datetime

    stamp = alert["activeAt"]
    head, _, frac = stamp.rstrip("Z").partition(".")
    return datetime.fromisoformat(head + "+00:00").timestamp() + float(f"0.{frac or 0}")


@pytest.mark.slow
@pytest.mark.parametrize("frozen", [1, pytest.param(0, marks=pytest.mark.ci)])  # rank 0 frozen too: CI's stage
def test_a_frozen_rank_alerts_before_the_watch_ends_it_and_the_dead_job_alerts(
        frozen: int, prometheus: Callable[[list[str]], Prometheus], tmp_path: Path) -> None:
    port = two_free_ports()
    server = prometheus([f"127.0.0.1:{port + 1}"])  # the launcher, as the PodMonitor: it passes rank 0's on
    proc = start("train", *sets("run.name=frozen", "train.max_steps=100000", "checkpoint.every_steps=100000",
                                "eval.every_steps=100000", "dist.hang_timeout_seconds=8",
                                "track.prometheus.enabled=true", f"track.prometheus.port={port}",
                                "track.prometheus.host=127.0.0.1"),
                 "--nproc", "2", "--max-restarts", "0", cwd=tmp_path)
    run = tmp_path / "runs" / "frozen"
    wait_until(lambda: lines_in(run / "metrics.jsonl") >= 3, proc)
    deadline = time.monotonic() + SAFETY
    while not server.query('kubetrain_step{run="frozen"}'):  # rank 0's gauges, passed on by its launcher
        assert proc.poll() is None and time.monotonic() < deadline, server.alerts()
        time.sleep(0.2)
    assert not server.firing("KubetrainTrainingHung")
    stopped_at = time.time()
    os.kill(next(pid for pid in children(proc.pid) if rank_of(pid) == frozen), signal.SIGSTOP)
    hung = server.wait_firing("KubetrainTrainingHung", ok=lambda: proc.poll() is None)
    fired_at = time.time()
    _, err = proc.communicate(timeout=SAFETY)
    assert proc.returncode == EXIT_FAILURE, err[-3000:]
    [hang] = read_all(run)
    assert (hang["kind"], hang["rank"]) == ("hang", frozen), hang
    # the page went out while the stuck processes still lived: before the watch ended them
    assert min(_when(a) for a in hung) < hang["time"], (hung, hang)
    assert {a["labels"].get("rank") for a in hung} <= {"0", "1"} and hung[0]["labels"]["run"] == "frozen"
    [failed] = server.wait_firing("KubetrainJobFailed")
    assert failed["labels"]["run"] == "frozen"
    print(f"rank {frozen} SIGSTOPped: alert firing after {fired_at - stopped_at:.1f}s (activeAt "
          f"{min(_when(a) for a in hung) - stopped_at:.1f}s), hang incident after {hang['time'] - stopped_at:.1f}s, "
          f"job-failed alert after {time.time() - stopped_at:.1f}s")


def test_a_straggler_among_two_and_among_four_ranks_fires_and_is_named(
        prometheus: Callable[[list[str]], Prometheus], tmp_path: Path) -> None:
    """Rank 0's real exporter with the window seconds a 1.5x slower rank gives (the old rule, over the median
    of all ranks, needed 3x with two); a 1.4x rank beside them does not fire."""
    windows = {"two": [1.0, 1.5], "four": [1.0, 1.0, 1.5, 1.0], "calm": [1.0, 1.4]}
    sinks = {}
    for name, seconds in windows.items():
        sink = PrometheusSink(0, "127.0.0.1", stream=io.StringIO())
        sink.start({"run": name, "run_dir": str(tmp_path)})
        sink.log({"kind": "train", "step": 10, **Stragglers.of(seconds).record()})
        sinks[name] = sink
    try:
        server = prometheus([f"127.0.0.1:{s.port}" for s in sinks.values()])
        deadline = time.monotonic() + SAFETY
        while len(firing := server.firing("KubetrainStraggler")) < 2:
            assert time.monotonic() < deadline, server.alerts()
            time.sleep(0.2)
        time.sleep(2.5)  # two more evaluations: the calm run would have joined by now
        named = {(a["labels"]["run"], a["labels"]["rank"]) for a in server.firing("KubetrainStraggler")}
        assert named == {("two", "1"), ("four", "2")}, firing
    finally:
        for sink in sinks.values():
            sink.finish("finished")


@pytest.mark.slow
@pytest.mark.ci  # a heavy end-to-end proof (many processes): .ci/run runs it, not the README's test command
def test_a_launcher_killed_from_outside_alerts_and_one_that_finished_does_not(
        prometheus: Callable[[list[str]], Prometheus], tmp_path: Path) -> None:
    """kill -9 of a launcher (what the OOM killer and a lost node do to it): its scrape fails, its series vanish, and
    KubetrainLauncherGone names it; a launcher whose workers finished said so to its last scrape and stays quiet,
    and so does one stopped by SIGTERM (a planned stop is no lost launcher:
    an alert for each would page someone for every `k8s stop`)."""
    done_port, killed_port = two_free_ports(), two_free_ports()
    while killed_port in (done_port, done_port + 1) or killed_port + 1 == done_port:
        killed_port = two_free_ports()
    server = prometheus([f"127.0.0.1:{done_port + 1}", f"127.0.0.1:{killed_port + 1}"])

    def train(name: str, port: int, steps: int) -> subprocess.Popen[str]:
        return start("train", *sets(f"run.name={name}", f"train.max_steps={steps}", "checkpoint.every_steps=100000",
                                    "eval.every_steps=100000", "track.prometheus.enabled=true",
                                    f"track.prometheus.port={port}", "track.prometheus.host=127.0.0.1"),
                     "--nproc", "2", cwd=tmp_path)

    def scraped(name: str) -> bool:
        return bool(server.query(f'kubetrain_worker_restarts{{run="{name}"}}'))

    done = train("done", done_port, 12)
    wait_until(lambda: scraped("done"), done, poll=0.2)
    _, err = done.communicate(timeout=SAFETY)
    assert done.returncode == 0, err[-3000:]
    assert server.query('max_over_time(kubetrain_job_finished{run="done"}[1m]) == 1'), "its last scrape"
    stopped = train("stopped", killed_port, 100000)  # `k8s stop`, a preemption: a planned end says so
    wait_until(lambda: scraped("stopped") and lines_in(tmp_path / "runs" / "stopped" / "metrics.jsonl") >= 2,
               stopped, poll=0.2)  # training: the agent handles SIGTERM from its start (before, Python's default)
    stopped.send_signal(signal.SIGTERM)
    _, err = stopped.communicate(timeout=SAFETY)
    assert stopped.returncode == 75, err[-3000:]
    assert server.query('max_over_time(kubetrain_job_stopped{run="stopped"}[1m]) == 1'), "its last scrape"
    killed = train("killed", killed_port, 100000)
    wait_until(lambda: scraped("killed"), killed, poll=0.2)
    killed_at = time.time()
    killed.kill()  # SIGKILL: no goodbye; its workers die with it (PR_SET_PDEATHSIG)
    killed.wait(timeout=SAFETY)
    [gone] = server.wait_firing("KubetrainLauncherGone")
    assert gone["labels"]["run"] == "killed", gone
    time.sleep(2.5)  # two more evaluations: the finished run would have joined by now
    assert [a["labels"]["run"] for a in server.firing("KubetrainLauncherGone")] == ["killed"]  # not `stopped`
    assert not server.firing("KubetrainJobFailed")
    print(f"launcher SIGKILLed: KubetrainLauncherGone firing after {_when(gone) - killed_at:.1f}s (activeAt)")

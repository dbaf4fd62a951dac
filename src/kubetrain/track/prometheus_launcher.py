"""The launcher's own /metrics and /healthz: its workers' heartbeats, its incidents, and whether it gave up.

Rank 0's exporter (track/prometheus.py) lives in a worker: when that worker is frozen its scrapes fail, and when
the workers are killed for a restart or the job dies its series vanish, so an alert on them goes quiet exactly
when it matters. The launcher outlives its workers. It serves, on `track.prometheus.port + 1` of every node:

- `kubetrain_rank_heartbeat_timestamp_seconds{rank}`, `kubetrain_rank_step{rank}`: each live local worker's last
  finished step (read from the heartbeat files at scrape time, so a frozen rank shows as an old timestamp);
- `kubetrain_hang_alert_seconds`: after how long without a step the hang alert fires (config/clocks.py);
- `kubetrain_worker_restarts`: the elastic restart round (a resume by a new launcher is `kubetrain_starts`);
- `kubetrain_incidents_total{kind, rank}`: the incidents this launcher recorded;
- `kubetrain_job_failed`: 1 once the launcher gave up (no restarts left); `kubetrain_job_finished`: 1 once its
  workers finished the run; `kubetrain_job_stopped`: 1 once it was stopped by SIGTERM/SIGINT (`kubetrain k8s
  stop`, a preemption, a node drain: a planned end, not a lost launcher). Before it exits it waits for one more
  scrape (if it was ever scraped), so the outcome is stored and the rules can tell a launcher that ended on its
  own from one that vanished (killed from outside, its node lost: KubetrainLauncherGone).

`/healthz` is the pod's liveness probe: 200 while a rank of this node finished a step within the liveness clock
(config/clocks.py, judged by the watch: launch/watch.py HangWatch.health), 503 after; JSON details either way.
A worker cannot answer for itself: stopped (SIGSTOP, a frozen node) its port accepts and never replies, so a
probe of rank 0's own /healthz ended the pod within a minute, before the watch could name the rank or save stacks.

It also passes on rank 0's own /metrics when rank 0 runs on this node: c10d gives global rank 0 to whichever
node's agent the rendezvous sorts first, not to node rank 0, so the PodMonitor scrapes the launcher of every
pod and rank 0's gauges arrive from the pod that holds it, whichever that is. A frozen rank 0 costs that part
of the scrape (WORKER_FETCH_SECONDS), never the launcher's own series.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kubetrain.track.failures import TrackerUnavailable
from kubetrain.track.prometheus import QuietHandler, QuietServer

WORKER_FETCH_SECONDS = 0.5  # how long a scrape waits for rank 0's exporter on this node
LINGER_MAX_SECONDS = 65.0  # the longest a failed launcher waits for its last scrape (2 x the default 30 s + slack)


@dataclass(frozen=True)
class RankBeat:
    rank: int
    step: int
    time: float


class LauncherExporter:
    """A small collector over the watch's state, served on its own port from a daemon thread."""

    def __init__(self, port: int, host: str, run: str, alert_seconds: float,
                 beats: Callable[[], list[RankBeat]], restart_round: Callable[[], int],
                 worker_port: int | None = None,
                 health: Callable[[], tuple[bool, dict[str, Any]]] = lambda: (True, {"status": "unjudged"})
                 ) -> None:
        self.requested_port, self.host, self.run = port, host, run
        self.worker_port = worker_port  # rank 0's exporter, if rank 0 runs here (track/prometheus.py)
        self.alert_seconds = alert_seconds
        self.beats, self.restart_round, self.health = beats, restart_round, health
        self.incidents: dict[tuple[str, str], int] = {}
        self.failed_at: float | None = None
        self.finished_at: float | None = None
        self.stopped_at: float | None = None  # when a SIGTERM/SIGINT ended the launcher
        self.scrapes: list[float] = []  # monotonic times the last scrapes of /metrics began (each once answered)
        self.scraper_seen = False  # a scrape of /metrics began: someone will come back for the last one
        self._scraped = threading.Condition()
        self.server: ThreadingHTTPServer | None = None

    @property
    def port(self) -> int:
        return int(self.server.server_address[1]) if self.server else self.requested_port

    def start(self, stream: Any = None) -> LauncherExporter:
        from prometheus_client import CollectorRegistry

        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)  # a collector: anything with collect()
        try:
            self.server = QuietServer((self.host, self.requested_port), _handler(self))
        except OSError as e:
            raise TrackerUnavailable(f"launcher metrics: cannot listen on {self.host}:{self.requested_port} "
                                     f"({e.strerror or e}); the job runs without them") from None
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, name="kubetrain-launcher-metrics", daemon=True).start()
        print(f"launcher: /metrics and /healthz on http://{self.host}:{self.port}", file=stream or sys.stderr,
              flush=True)
        return self

    def incident(self, entry: dict[str, Any]) -> None:
        key = (str(entry["kind"]), "" if entry.get("rank") is None else str(entry["rank"]))
        self.incidents[key] = self.incidents.get(key, 0) + 1

    def close(self, failed: bool, finished: bool = False, stopped: bool = False) -> None:
        """Stop serving; a launcher that gave up (whose workers finished, that was stopped by a signal) first lets
        its scraper read `kubetrain_job_failed 1` (`kubetrain_job_finished 1`, `kubetrain_job_stopped 1`)."""
        if self.server is None:
            return
        if failed or finished or stopped:
            with self._scraped:
                ended_at = time.monotonic()
                if failed:
                    self.failed_at = ended_at
                elif finished:
                    self.finished_at = ended_at
                else:
                    self.stopped_at = ended_at
                if self.scraper_seen:  # not `self.scrapes`: a scrape answered just now may not be recorded yet
                    gap = self.scrapes[-1] - self.scrapes[-2] if len(self.scrapes) > 1 else LINGER_MAX_SECONDS / 2
                    self._scraped.wait_for(lambda: bool(self.scrapes) and self.scrapes[-1] > ended_at,
                                           min(2 * gap + 1, LINGER_MAX_SECONDS))
        self.server.shutdown()
        self.server.server_close()
        self.server = None

    def scraped(self, began: float) -> None:
        with self._scraped:
            self.scrapes = [*self.scrapes[-1:], began]
            self._scraped.notify_all()

    def worker_metrics(self) -> bytes:
        """Rank 0's exposition (text format) when this node holds rank 0 and it answers in time; else nothing."""
        if not self.worker_port or not any(b.rank == 0 for b in self.beats()):
            return b""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.worker_port}/metrics",
                                        timeout=WORKER_FETCH_SECONDS) as r:
                return bytes(r.read())
        except (OSError, ValueError):  # refused, timed out (a frozen rank 0), or going away
            return b""

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        run = {"run": self.run}
        beat = GaugeMetricFamily("kubetrain_rank_heartbeat_timestamp_seconds",
                                 "Unix time a rank of this node last finished a step (from the launcher).",
                                 labels=["run", "rank"])
        step = GaugeMetricFamily("kubetrain_rank_step", "The step a rank of this node last finished.",
                                 labels=["run", "rank"])
        for b in self.beats():
            beat.add_metric([self.run, str(b.rank)], b.time)
            step.add_metric([self.run, str(b.rank)], b.step)
        yield beat
        yield step
        for name, doc, value in (
            ("kubetrain_hang_alert_seconds", "Seconds without a step after which the hang alert fires.",
             self.alert_seconds),
            ("kubetrain_worker_restarts", "Elastic restarts of the workers by this launcher.", self.restart_round()),
            ("kubetrain_job_failed", "1 once the launcher gave up (no restarts left).",
             float(self.failed_at is not None)),
            ("kubetrain_job_finished", "1 once the launcher's workers finished the run.",
             float(self.finished_at is not None)),
            ("kubetrain_job_stopped", "1 once the launcher was stopped by SIGTERM/SIGINT (a planned end).",
             float(self.stopped_at is not None)),
        ):
            g = GaugeMetricFamily(name, doc, labels=list(run))
            g.add_metric([self.run], value)
            yield g
        counted = CounterMetricFamily("kubetrain_incidents", "Incidents recorded by this launcher.",
                                      labels=["run", "kind", "rank"])
        for (kind, rank), n in sorted(self.incidents.items()):
            counted.add_metric([self.run, kind, rank], n)
        yield counted


def _handler(exporter: LauncherExporter) -> type[BaseHTTPRequestHandler]:
    from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

    class Handler(QuietHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/healthz":
                alive, details = exporter.health()
                self._reply(200 if alive else 503, "application/json", json.dumps(details).encode())
                return
            if path != "/metrics":
                self._reply(404, "text/plain; charset=utf-8", b"not found\n")
                return
            began = time.monotonic()
            exporter.scraper_seen = True
            # the text format, in which two expositions of distinct families concatenate into one
            self._reply(200, CONTENT_TYPE_LATEST, generate_latest(exporter.registry) + exporter.worker_metrics())
            exporter.scraped(began)  # after the reply: the scraper holds what was read from `began` on

    return Handler

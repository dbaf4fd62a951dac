"""Prometheus exporter and liveness endpoint on one port: `/metrics` for scraping, `/healthz` for Kubernetes.

`/healthz` answers 200 while the loop's heartbeat (one per finished step) is fresh and 503 once it has not
advanced for `health_timeout_seconds`: a hung collective or a stuck data loader then gets the pod restarted.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from kubetrain import runs
from kubetrain.secrets import redact_text
from kubetrain.track import Sink
from kubetrain.track.failures import TrackerUnavailable, missing_package

LABELS = ("run", "phase")
NO_PHASE = "none"  # label value for a run without phases (an empty label is the same as no label in PromQL)

# name -> help; every gauge carries the run and phase labels.
GAUGES = {
    "kubetrain_step": "Optimizer steps finished.",
    "kubetrain_max_steps": "Optimizer steps this run (phase) trains for.",
    "kubetrain_tokens_seen": "Training tokens consumed so far.",
    "kubetrain_train_loss": "Training loss, mean over the last logging window.",
    "kubetrain_val_loss": "Validation loss at the last evaluation.",
    "kubetrain_val_perplexity": "Validation perplexity at the last evaluation.",
    "kubetrain_learning_rate": "Learning rate of the last step.",
    "kubetrain_tokens_per_second": "Training throughput over the last logging window, all ranks.",
    "kubetrain_mfu": "Model FLOPs utilisation (0-1) against the device's peak.",
    "kubetrain_memory_bytes": "Peak accelerator (or process) memory in use on rank 0.",
    "kubetrain_eta_seconds": "Estimated time left.",
    "kubetrain_last_checkpoint_step": "Step of the newest saved checkpoint.",
    "kubetrain_restarts": "Times torch.distributed.run restarted the workers (elastic restarts).",
    "kubetrain_starts": "Times a launcher started this run; above 1 the run resumed (pod restart, preemption, "
    "relaunch). Elastic worker restarts are kubetrain_restarts.",
    "kubetrain_world_size": "Training processes.",
    "kubetrain_heartbeat_timestamp_seconds": "Unix time the last training step finished.",
    "kubetrain_checkpoint_upload_failures": "Checkpoints of this run whose upload to checkpoint.uri failed so far.",
}

# name -> help; labelled with the rank as well (distributed runs, filled at log steps)
RANK_GAUGES = {
    "kubetrain_rank_compute_seconds": "Data wait + forward over the last logging window, per rank (the time "
    "before the gradient collective).",
    "kubetrain_rank_straggler_ratio": "A rank's compute seconds over the median of the other ranks' (above 1: "
    "slower; with 2 ranks, over the other rank's).",
}

# name -> help; from the job's preflight before step 1 (distributed/preflight.py), set when the sink starts
PREFLIGHT_GAUGES = {
    "kubetrain_preflight_ok": "1 when the preflight before step 1 named no rank, 0 when it did (on_failure warn).",
    "kubetrain_preflight_seconds": "Seconds the preflight took (bounded by dist.preflight.budget_seconds).",
}
PREFLIGHT_RANK_GAUGES = {
    "kubetrain_preflight_device_ok": "1 when the rank's device passed the preflight (matmul, memory, driver).",
    "kubetrain_preflight_all_reduce_bus_bytes_per_second": "The rank's all-reduce bus bandwidth in the preflight "
    "(nccl-tests' busbw: algbw x 2(n-1)/n).",
    "kubetrain_preflight_all_reduce_latency_seconds": "The rank's all-reduce time of one float in the preflight.",
    "kubetrain_preflight_link_bytes_per_second": "The slowest send/recv bandwidth between the rank and a ring "
    "neighbour in the preflight.",
    "kubetrain_preflight_clock_offset_seconds": "The rank's wall clock minus rank 0's, in the preflight.",
}

Clock = Callable[[], float]


class PrometheusSink(Sink):
    """Gauges in a registry of their own (not the process-wide default), served with /healthz on one port."""

    name = "prometheus"

    def __init__(
        self,
        port: int,
        host: str = "0.0.0.0",
        health_timeout_seconds: float = 600.0,
        clock: Clock = time.monotonic,
        stream: Any = None,
    ) -> None:
        self.host = host
        self.requested_port = port
        self.timeout = health_timeout_seconds
        self.clock = clock
        self.stream = stream
        self.server: ThreadingHTTPServer | None = None
        self.step = 0
        self.last_beat = clock()
        self.labels: dict[str, str] = {"run": "", "phase": NO_PHASE}
        self.gauges: dict[str, Any] = {}
        self.registry: Any = None

    @property
    def port(self) -> int:
        """The bound port (the real one when 0 was asked for)."""
        return int(self.server.server_address[1]) if self.server else self.requested_port

    def start(self, info: dict[str, Any]) -> None:
        try:
            from prometheus_client import CollectorRegistry, Gauge
        except ImportError:
            raise missing_package("prometheus-client") from None
        self.registry = CollectorRegistry(auto_describe=True)
        self.gauges = {name: Gauge(name, doc, LABELS, registry=self.registry) for name, doc in GAUGES.items()}
        self.gauges.update({name: Gauge(name, doc, LABELS, registry=self.registry)
                            for name, doc in PREFLIGHT_GAUGES.items()})
        self.gauges.update({name: Gauge(name, doc, (*LABELS, "rank"), registry=self.registry)
                            for name, doc in {**RANK_GAUGES, **PREFLIGHT_RANK_GAUGES}.items()})
        self.labels = {"run": redact_text(str(info.get("run") or "")), "phase": str(info.get("phase") or NO_PHASE)}
        self.step = int(info.get("start_step", 0))
        self._set("kubetrain_step", self.step)
        self._set("kubetrain_max_steps", info.get("max_steps"))
        self._set("kubetrain_restarts", info.get("restarts", 0))
        self._set("kubetrain_world_size", info.get("world_size", 1))
        meta = runs.read_meta(Path(info["run_dir"])) if info.get("run_dir") else {}
        self._set("kubetrain_starts", meta.get("starts", 1))
        self._set("kubetrain_last_checkpoint_step", info.get("last_checkpoint_step"))
        self._set("kubetrain_val_loss", info.get("val_loss"))
        if info.get("run_dir"):
            self._set_preflight(runs.read_preflight(Path(info["run_dir"])))
        self.last_beat = self.clock()
        self._set("kubetrain_heartbeat_timestamp_seconds", time.time())
        try:
            self.server = QuietServer((self.host, self.requested_port), _handler(self))
        except OSError as e:
            raise TrackerUnavailable(
                f"cannot listen on {self.host}:{self.requested_port} ({e.strerror or e}); "
                "training goes on without /metrics and /healthz"
            ) from None
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, name="kubetrain-metrics", daemon=True).start()
        print(f"prometheus: /metrics and /healthz on http://{self.host}:{self.port}",
              file=self.stream or sys.stdout, flush=True)

    def heartbeat(self, step: int) -> None:
        self.step = step
        self.last_beat = self.clock()
        self._set("kubetrain_step", step)
        self._set("kubetrain_heartbeat_timestamp_seconds", time.time())

    def log(self, record: dict[str, Any]) -> None:
        kind = record.get("kind")
        if kind == "train":
            self._set("kubetrain_step", record.get("step"))
            self._set("kubetrain_tokens_seen", record.get("tokens"))
            self._set("kubetrain_train_loss", record.get("loss"))
            self._set("kubetrain_learning_rate", record.get("lr"))
            self._set("kubetrain_tokens_per_second", record.get("tokens_per_second"))
            self._set("kubetrain_mfu", record.get("mfu"))
            gib = record.get("memory_gib")
            self._set("kubetrain_memory_bytes", None if gib is None else gib * 2**30)
            self._set("kubetrain_eta_seconds", record.get("eta_seconds"))
            self._set_ranks(record.get("rank_compute_seconds"), record.get("rank_straggler_ratios"))
            self._set("kubetrain_checkpoint_upload_failures", record.get("upload_failures"))
        elif kind == "eval":
            self._set("kubetrain_val_loss", record.get("val_loss"))
            self._set("kubetrain_val_perplexity", record.get("val_ppl"))
        elif kind == "checkpoint":
            self._set("kubetrain_last_checkpoint_step", record.get("step"))

    def health(self) -> tuple[bool, dict[str, Any]]:
        """(fresh, details): fresh while the last heartbeat is younger than the timeout."""
        age = self.clock() - self.last_beat
        fresh = age <= self.timeout
        return fresh, {"status": "ok" if fresh else "stale", "step": self.step,
                       "seconds_since_step": round(age, 3), "timeout_seconds": self.timeout}

    def finish(self, status: str) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def _set_ranks(self, seconds: list[float] | None, ratios: list[float] | None) -> None:
        """Each rank's window seconds and its ratio to the others (train/straggler.py computes it)."""
        if not seconds or not ratios or len(ratios) != len(seconds):
            return
        for rank, (value, ratio) in enumerate(zip(seconds, ratios, strict=True)):
            labels = {**self.labels, "rank": str(rank)}
            self.gauges["kubetrain_rank_compute_seconds"].labels(**labels).set(value)
            self.gauges["kubetrain_rank_straggler_ratio"].labels(**labels).set(ratio)

    def _set_preflight(self, report: dict[str, Any]) -> None:
        """The job's preflight table (none: one process, or the preflight off): job-wide and per-rank gauges."""
        if not report.get("ranks"):
            return
        self._set("kubetrain_preflight_ok", bool(report["verdict"]["ok"]))
        self._set("kubetrain_preflight_seconds", report.get("seconds"))
        for entry in report["ranks"]:
            labels = {**self.labels, "rank": str(entry["rank"])}
            slowest = min((bandwidth for _, bandwidth in entry["links"]), default=None)
            values = {"kubetrain_preflight_device_ok": bool(entry["device"]["ok"]),
                      "kubetrain_preflight_all_reduce_bus_bytes_per_second": entry["all_reduce"]["busbw"],
                      "kubetrain_preflight_all_reduce_latency_seconds": entry["all_reduce"]["latency_seconds"],
                      "kubetrain_preflight_link_bytes_per_second": slowest,
                      "kubetrain_preflight_clock_offset_seconds": entry["clock_offset_seconds"]}
            for name, value in values.items():
                if value is not None:
                    self.gauges[name].labels(**labels).set(float(value))

    def _set(self, name: str, value: Any) -> None:
        if value is not None:
            self.gauges[name].labels(**self.labels).set(float(value))


class QuietServer(ThreadingHTTPServer):
    """A threading HTTP server that says nothing when a client goes away mid-request: a scrape that timed out
    closes its connection, and socketserver printed a BrokenPipeError (or ConnectionResetError) traceback for each.
    Any other error in a handler is still printed."""

    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


class QuietHandler(BaseHTTPRequestHandler):
    """An HTTP handler that replies with a body in one call and logs nothing (a scrape every few seconds would
    drown the training log)."""

    def _reply(self, code: int, content_type: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Silent."""


def _handler(sink: PrometheusSink) -> type[BaseHTTPRequestHandler]:
    from prometheus_client.exposition import choose_encoder

    class Handler(QuietHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
                self._reply(200, content_type, encoder(sink.registry))
            elif path == "/healthz":
                fresh, details = sink.health()
                self._reply(200 if fresh else 503, "application/json", json.dumps(details).encode())
            elif path == "/":
                self._reply(200, "text/plain; charset=utf-8", b"kubetrain: /metrics /healthz\n")
            else:
                self._reply(404, "text/plain; charset=utf-8", b"not found\n")

    return Handler

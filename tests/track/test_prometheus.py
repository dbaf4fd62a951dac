"""The Prometheus exporter and /healthz: driven directly, and scraped over HTTP during a real training run."""

from __future__ import annotations

import contextlib
import io
import json
import re
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kubetrain.runs.reader import read_metrics
from kubetrain.track.prometheus import GAUGES, PrometheusSink
from kubetrain.train.straggler import Stragglers

from .conftest import TOKENS_PER_STEP, TrainTiny


def get(port: int, path: str) -> tuple[int, str]:
    """(status, body) of a real HTTP GET; 4xx/5xx are answers here, not errors."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def scrape(port: int) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """/metrics parsed with prometheus-client's own parser: {sample name: {sorted labels: value}}."""
    status, text = get(port, "/metrics")
    assert status == 200
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


class Clock:
    """A clock the test moves by hand, so 'stale' needs no waiting."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_health_goes_stale_without_heartbeat_and_recovers(tmp_path: Path) -> None:
    clock = Clock()
    sink = PrometheusSink(0, "127.0.0.1", health_timeout_seconds=30, clock=clock, stream=io.StringIO())
    sink.start({"run": "unit", "phase": "code", "run_dir": str(tmp_path), "start_step": 0, "max_steps": 50,
                "restarts": 2, "world_size": 4})
    try:
        sink.heartbeat(1)
        status, body = get(sink.port, "/healthz")
        assert status == 200 and json.loads(body)["status"] == "ok"
        clock.now += 29
        assert get(sink.port, "/healthz")[0] == 200
        clock.now += 2  # 31 s without a finished step: past the 30 s limit
        status, body = get(sink.port, "/healthz")
        assert status == 503
        assert json.loads(body) == {"status": "stale", "step": 1, "seconds_since_step": 31.0,
                                    "timeout_seconds": 30}
        sink.heartbeat(2)
        assert get(sink.port, "/healthz")[0] == 200
        assert get(sink.port, "/nothing-here")[0] == 404
    finally:
        sink.finish("finished")


def test_gauges_carry_values_and_labels(tmp_path: Path) -> None:
    sink = PrometheusSink(0, "127.0.0.1", stream=io.StringIO())
    sink.start({"run": "unit", "phase": "instruct", "run_dir": str(tmp_path), "start_step": 40,
                "max_steps": 50, "restarts": 1, "world_size": 2})
    try:
        sink.heartbeat(41)
        sink.log({"kind": "train", "step": 41, "loss": 2.5, "lr": 1e-4, "tokens": 4096,
                  "tokens_per_second": 900.0, "mfu": 0.31, "memory_gib": 1.5, "eta_seconds": 12.0,
                  "upload_failures": 2})
        sink.log({"kind": "eval", "step": 41, "val_loss": 2.75, "val_ppl": 15.6, "tokens": 4096})
        sink.log({"kind": "checkpoint", "step": 41, "path": "x/step-000041", "best": True})
        m = scrape(sink.port)
    finally:
        sink.finish("finished")
    labels = (("phase", "instruct"), ("run", "unit"))
    expected = {
        "kubetrain_step": 41, "kubetrain_max_steps": 50, "kubetrain_restarts": 1, "kubetrain_world_size": 2,
        "kubetrain_train_loss": 2.5, "kubetrain_learning_rate": 1e-4, "kubetrain_tokens_seen": 4096,
        "kubetrain_tokens_per_second": 900.0, "kubetrain_mfu": 0.31, "kubetrain_memory_bytes": 1.5 * 2**30,
        "kubetrain_eta_seconds": 12.0, "kubetrain_val_loss": 2.75, "kubetrain_val_perplexity": 15.6,
        "kubetrain_last_checkpoint_step": 41, "kubetrain_checkpoint_upload_failures": 2,
    }
    for name, value in expected.items():
        assert m[name] == {labels: pytest.approx(value)}, name
    assert set(GAUGES) <= set(m)  # every documented gauge is exported


def test_a_resumed_run_reports_its_checkpoint_and_val_loss_before_the_next_save(tmp_path: Path) -> None:
    sink = PrometheusSink(0, "127.0.0.1", stream=io.StringIO())
    sink.start({"run": "unit", "run_dir": str(tmp_path), "start_step": 40, "last_checkpoint_step": 40,
                "val_loss": 2.5})
    try:
        m = scrape(sink.port)
    finally:
        sink.finish("finished")
    assert list(m["kubetrain_last_checkpoint_step"].values()) == [40]
    assert list(m["kubetrain_val_loss"].values()) == [2.5]


def test_a_gauge_per_rank_names_the_straggler(tmp_path: Path) -> None:
    sink = PrometheusSink(0, "127.0.0.1", stream=io.StringIO())
    sink.start({"run": "unit", "run_dir": str(tmp_path)})
    try:
        sink.log({"kind": "train", "step": 5, **Stragglers.of([1.0, 1.5, 4.5]).record()})
        m = scrape(sink.port)
    finally:
        sink.finish("finished")
    ratio = {dict(k)["rank"]: v for k, v in m["kubetrain_rank_straggler_ratio"].items()}
    # each over the median of the others: rank 2 over (1.0, 1.5) -> 1.25
    assert ratio == pytest.approx({"0": 1 / 3, "1": 1.5 / 2.75, "2": 4.5 / 1.25}, rel=1e-3)
    assert {dict(k)["rank"]: v for k, v in m["kubetrain_rank_compute_seconds"].items()}["2"] == 4.5


@pytest.mark.slow
def test_port_taken_warns_once_and_training_goes_on(train_tiny: TrainTiny, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = train_tiny("track.prometheus.enabled=true", "track.prometheus.host=127.0.0.1",
                            f"track.prometheus.port={port}")
    assert result.status == "finished" and result.steps == 20
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1
    assert "'prometheus'" in warnings[0] and f"127.0.0.1:{port}" in warnings[0]
    assert "training goes on" in warnings[0]
    records = read_metrics(Path(result.run_dir) / "metrics.jsonl")
    assert [r["step"] for r in records if r["kind"] == "train"] == [5, 10, 15, 20]


class LineHook(io.StringIO):
    """Stands in for stdout: the console sink prints a line per record, and the hook acts on it right there,
    inside the training loop, while the exporter's thread serves requests."""

    def __init__(self, on_line: Any) -> None:
        super().__init__()
        self.on_line = on_line

    def write(self, text: str) -> int:
        for line in text.splitlines():
            self.on_line(line)
        return super().write(text)

    def isatty(self) -> bool:
        return False


@pytest.mark.slow
def test_live_scrape_and_health_during_training(train_tiny: TrainTiny, tmp_path: Path) -> None:
    seen: dict[str, Any] = {"errors": []}
    metrics_file = tmp_path / "runs" / "obs" / "metrics.jsonl"

    def on_line(line: str) -> None:
        try:
            if found := re.match(r"prometheus: .* on http://[\d.]+:(\d+)", line):
                seen["port"] = int(found.group(1))
            elif progress := re.match(r"step (\d+)/", line):
                step = int(progress.group(1))
                if "step" in seen:
                    seen.setdefault("healthz_after", get(seen["port"], "/healthz")[0])
                    return
                records = read_metrics(metrics_file)
                # The step-5 save is written in the background and recorded at a step boundary once written: a
                # loaded machine records it later. Scrape at the first log step from 10 on that follows the record
                # (by step 15 it has one: the step-10 save waited for it, and step 11 recorded it).
                if step < 10 or not any(r["kind"] == "checkpoint" for r in records):
                    return
                port = seen["port"]
                seen.update(step=step, records=records, healthz=get(port, "/healthz")[0], metrics=scrape(port))
                # The loop is held here (a hung collective, say): /healthz must turn 503 past the 1 s limit.
                for _ in range(600):
                    status, body = get(port, "/healthz")
                    if status == 503:
                        seen["stale"] = json.loads(body)
                        break
                    time.sleep(0.05)
        except Exception as e:  # a failure here would only switch the console sink off: keep it for the test
            seen["errors"].append(repr(e))

    hook = LineHook(on_line)
    with contextlib.redirect_stdout(hook):
        result = train_tiny("track.prometheus.enabled=true", "track.prometheus.host=127.0.0.1",
                            "track.prometheus.port=0", "track.prometheus.health_timeout_seconds=1",
                            # one process: a 1 s /healthz needs the clocks before it as short (config/clocks.py)
                            "dist.hang_timeout_seconds=null", "dist.timeout_seconds=1",
                            "checkpoint.save_best=true")
    assert seen["errors"] == []
    assert result.status == "finished"
    assert seen["healthz"] == 200
    m, labels, step, records = seen["metrics"], (("phase", "none"), ("run", "obs")), seen["step"], seen["records"]
    assert step in (10, 15)
    train_now = next(r for r in records if r["kind"] == "train" and r["step"] == step)
    last_eval = [r for r in records if r["kind"] == "eval"][-1]  # this step's evaluation comes after its log line
    last_save = [r for r in records if r["kind"] == "checkpoint"][-1]
    assert last_eval["step"] == step - 5
    assert m["kubetrain_step"] == {labels: step}
    assert m["kubetrain_tokens_seen"] == {labels: step * TOKENS_PER_STEP}
    assert m["kubetrain_train_loss"] == {labels: pytest.approx(train_now["loss"])}
    assert m["kubetrain_learning_rate"] == {labels: pytest.approx(train_now["lr"])}
    assert m["kubetrain_tokens_per_second"][labels] > 0
    assert m["kubetrain_memory_bytes"][labels] > 0
    assert m["kubetrain_val_loss"] == {labels: pytest.approx(last_eval["val_loss"])}
    # the first eval is the best so far: saved (save_best) at 5; the gauge is the newest recorded save
    assert last_save["step"] in (5, 10) and m["kubetrain_last_checkpoint_step"] == {labels: last_save["step"]}
    assert m["kubetrain_max_steps"] == {labels: 20}
    assert seen["stale"]["status"] == "stale" and seen["stale"]["step"] == step
    assert seen["healthz_after"] == 200  # steps finish again: healthy again
    with pytest.raises(OSError):  # the exporter shuts down with the run and frees its port
        socket.create_connection(("127.0.0.1", seen["port"]), timeout=5).close()


def test_a_scraper_that_goes_away_mid_request_prints_nothing(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # a scrape that timed out closes its connection while the exporter still reads or writes it: socketserver printed
    # a BrokenPipeError or ConnectionResetError traceback for each
    import struct

    sink = PrometheusSink(0, "127.0.0.1", stream=io.StringIO())
    sink.start({"run": "unit", "run_dir": str(tmp_path)})
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", sink.port)) as gone:
            gone.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # the headers never end
            time.sleep(0.1)  # the handler is reading them
            gone.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = reset
    with urllib.request.urlopen(f"http://127.0.0.1:{sink.port}/metrics", timeout=10) as reply:
        assert reply.status == 200  # the exporter still answers
    time.sleep(0.2)
    sink.finish("finished")
    assert capfd.readouterr().err == ""

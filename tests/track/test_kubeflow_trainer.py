"""Progress to Kubeflow Trainer's status server: a real training run against a local HTTPS server that answers as
the controller's does (kubeflow_status_server.py), and what happens when it cannot be reached."""

from __future__ import annotations

import io
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubetrain.config import load_config
from kubetrain.track.build import build_sinks
from kubetrain.track.kubeflow_trainer import (
    ENV_URL,
    KubeflowTrainerSink,
    StatusNotSent,
    StatusServer,
    post_status,
    trainer_status,
)
from tests.k8s.conftest import crd_folder  # noqa: F401  (fixture: skipped on a fresh clone, fails under CI)

from . import kubeflow_status_server as fake
from .conftest import TrainTiny
from .kubeflow_status_server import StatusServer as FakeServer
from .kubeflow_status_server import make_ca, serve

ENV_NAMES = ("KUBEFLOW_TRAINER_SERVER_URL", "KUBEFLOW_TRAINER_SERVER_CA_CERT", "KUBEFLOW_TRAINER_SERVER_TOKEN")


@pytest.fixture
def status_server(tmp_path: Path) -> Iterator[FakeServer]:
    folder = tmp_path / "tls"
    folder.mkdir()
    state, httpd = serve(folder)
    yield state
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def in_trainjob(status_server: FakeServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeServer:
    """This process looks like a trainer pod of a TrainJob whose controller has TrainJobStatus on."""
    for key, value in status_server.env(tmp_path / "token").items():
        monkeypatch.setenv(key, value)
    return status_server


def metrics_of(status: dict[str, Any]) -> dict[str, str]:
    return {m["name"]: m["value"] for m in status.get("metrics", [])}


def test_training_run_reports_increasing_progress_and_finishes_at_100(
    in_trainjob: FakeServer, train_tiny: TrainTiny, capsys: pytest.CaptureFixture[str]
) -> None:
    result = train_tiny("track.kubeflow_trainer.interval_seconds=1")
    assert result.status == "finished"
    posted = in_trainjob.accepted
    # the first log step (5 of 20) goes out at once, the end of the run always: steps between may be throttled
    assert len(posted) >= 2 and set(in_trainjob.answers) == {200}
    progress = [s["progressPercentage"] for s in posted]
    assert progress == sorted(progress) and progress[0] < progress[-1]
    for status in posted[:-1]:  # each says where the run was when it was logged
        assert status["progressPercentage"] == min(99, 100 * int(metrics_of(status)["step"]) // 20)
    final = posted[-1]
    assert final["progressPercentage"] == 100 and final["estimatedRemainingSeconds"] == 0
    final_metrics = metrics_of(final)
    assert final_metrics["step"] == "20" and final_metrics["max_steps"] == "20"
    for name in ("loss", "lr", "tokens_per_second", "val_loss", "val_ppl"):
        float(final_metrics[name])  # the latest value, as text
    out = capsys.readouterr()
    assert in_trainjob.token not in out.err + out.out


def test_bad_ca_warns_once_and_training_goes_on(
    in_trainjob: FakeServer, train_tiny: TrainTiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str]
) -> None:
    _, _, other_ca = make_ca(tmp_path, "someone-else")
    monkeypatch.setenv("KUBEFLOW_TRAINER_SERVER_CA_CERT", str(other_ca))
    result = train_tiny("track.kubeflow_trainer.interval_seconds=1")
    assert result.status == "finished" and result.steps == 20
    assert in_trainjob.accepted == []
    out = capsys.readouterr()
    warnings = [line for line in (out.err + out.out).splitlines() if "kubeflow trainer" in line and "warning" in line]
    assert len(warnings) == 1 and "certificate verify failed" in warnings[0], warnings
    assert in_trainjob.token not in out.err + out.out


def test_server_down_costs_one_warning(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = tmp_path / "token"
    token.write_text("t0ken-that-must-not-be-printed")
    warned: list[str] = []
    sink = KubeflowTrainerSink(StatusServer(f"https://127.0.0.1:{port}/status", None, str(token)),
                               interval_seconds=1.0, warn=warned.append, stream=io.StringIO())
    sink.start({"max_steps": 10})
    sink.log({"kind": "train", "step": 1, "loss": 2.0, "eta_seconds": 9.0})
    deadline = time.monotonic() + 60
    while sink.failed == 0 and time.monotonic() < deadline:  # the first post went out (off this thread)
        time.sleep(0.01)
    for step in range(2, 11):
        sink.log({"kind": "train", "step": step, "loss": 2.0, "eta_seconds": 10.0 - step})
    sink.finish("finished")
    assert sink.sent == 0 and sink.failed == 2  # the first post and the final one
    assert len(warned) == 1 and "Connection refused" in warned[0] and "t0ken" not in warned[0]


def test_throttled_posts_carry_the_newest_status(status_server: FakeServer, tmp_path: Path) -> None:
    server = StatusServer(status_server.url, str(status_server.ca_file), str(tmp_path / "token"))
    (tmp_path / "token").write_text(status_server.token)
    sink = KubeflowTrainerSink(server, interval_seconds=60.0, stream=io.StringIO())
    sink.start({"max_steps": 200, "phase": "code"})
    for step in range(1, 101):
        sink.log({"kind": "train", "step": step, "loss": 1.0 / step, "eta_seconds": 200.0 - step, "mfu": None})
    sink.log({"kind": "eval", "step": 100, "val_loss": 1.25, "val_ppl": 3.49})
    sink.finish("stopped")  # a stopped run sends where it stopped, not 100
    assert 1 <= len(status_server.accepted) <= 2 < 101
    last = status_server.accepted[-1]
    assert last["progressPercentage"] == 50 and last["estimatedRemainingSeconds"] == 100
    assert metrics_of(last) == {"step": "100", "loss": "0.01", "val_loss": "1.25", "val_ppl": "3.49",
                                "max_steps": "200", "phase": "code"}


def test_the_fake_refuses_what_the_controller_refuses(status_server: FakeServer, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("not-the-token")
    server = StatusServer(status_server.url, str(status_server.ca_file), str(token))
    good = trainer_status(10, 5.0, {"loss": 1.0}, 0.0)
    with pytest.raises(StatusNotSent, match="HTTP 403 Forbidden"):
        post_status(server, good)
    token.write_text(status_server.token)  # the kubelet rotated it: read again for every request
    post_status(server, good)
    with pytest.raises(StatusNotSent, match="HTTP 422 Invalid payload"):
        post_status(server, {"trainerStatus": {"progressPercentage": 10.0, "lastUpdatedTime": "1970-01-01T00:00:00Z"}})
    with pytest.raises(StatusNotSent, match="HTTP 422 lastUpdatedTime is required"):
        post_status(server, {"trainerStatus": {"progressPercentage": 10}})
    other_job = StatusServer(status_server.url.replace("/tiny/", "/other/"), str(status_server.ca_file), str(token))
    with pytest.raises(StatusNotSent, match="HTTP 403"):
        post_status(other_job, good)
    assert status_server.accepted == [good["trainerStatus"]]


def test_status_body_keeps_within_the_crd_limits() -> None:
    body = trainer_status(140, -3.0, {"x" * 80: 1.0 / 3, "n": 7, "gone": None, **{f"m{i}": i for i in range(300)}},
                          1_700_000_000.0)["trainerStatus"]
    assert body["progressPercentage"] == 100 and body["estimatedRemainingSeconds"] == 0
    assert len(body["metrics"]) == 256 and body["metrics"][0] == {"name": "x" * 64, "value": "0.333333"}
    assert {"name": "n", "value": "7"} in body["metrics"]
    assert body["lastUpdatedTime"] == "2023-11-14T22:13:20+00:00"
    assert trainer_status(None, None, {}, 0.0) == {"trainerStatus": {"lastUpdatedTime": "1970-01-01T00:00:00+00:00"}}


def test_sink_only_where_the_controller_set_the_variables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in ENV_NAMES:
        monkeypatch.delenv(key, raising=False)
    cfg = load_config(None, None, [f"run.output_dir={tmp_path}"])

    def names(cfg: Any) -> list[str]:
        fanout = build_sinks(cfg, tmp_path, 10, stream=io.StringIO())
        try:
            return [s.name for s in fanout.sinks]
        finally:
            fanout.finish("finished")

    assert "kubeflow-trainer" not in names(cfg)
    monkeypatch.setenv(ENV_URL, "https://kubeflow-trainer-controller-manager.kubeflow-system.svc:10443/x")
    assert "kubeflow-trainer" in names(cfg)
    off = load_config(None, None, [f"run.output_dir={tmp_path}", "track.kubeflow_trainer.enabled=false"])
    assert "kubeflow-trainer" not in names(off)


def test_plain_http_url_is_refused_so_the_token_never_travels_in_clear(tmp_path: Path) -> None:
    from kubetrain.track import Fanout

    warned: list[str] = []
    sink = KubeflowTrainerSink(StatusServer("http://127.0.0.1:9/status", None, None), stream=io.StringIO())
    fanout = Fanout([sink], warn=warned.append)
    fanout.start({"max_steps": 10})
    assert fanout.sinks == [] and "not an https URL" in warned[0]


def test_the_fakes_limits_are_the_crds(crd_folder: Path) -> None:  # noqa: F811
    crd = yaml.safe_load((crd_folder / "trainer.kubeflow.org_trainjobs.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    status = schema["properties"]["status"]["properties"]["trainerStatus"]
    fields = status["properties"]
    assert (fields["progressPercentage"]["minimum"], fields["progressPercentage"]["maximum"]) == (0, fake.MAX_PROGRESS)
    assert fields["estimatedRemainingSeconds"]["minimum"] == 0
    assert fields["metrics"]["maxItems"] == fake.MAX_METRICS
    for key in ("name", "value"):
        text = fields["metrics"]["items"]["properties"][key]
        assert (text["minLength"], text["maxLength"]) == (1, fake.MAX_TEXT)
    assert status["x-kubernetes-validations"] == [{"message": fake.NO_TIME, "rule": "has(self.lastUpdatedTime)"}]

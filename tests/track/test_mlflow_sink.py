"""MLflow: real stores (a SQLite file, a PostgreSQL server started here) read back with MlflowClient."""

from __future__ import annotations

import glob
import io
import json
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from kubetrain.config import load_config
from kubetrain.runs.reader import read_metrics
from kubetrain.track import Fanout
from kubetrain.track.mlflow_sink import MlflowSink, default_artifact_location, tracking_uri

from .conftest import TrainTiny


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def only_run(uri: str, experiment: str = "kubetrain") -> tuple[MlflowClient, str]:
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None
    found = client.search_runs([exp.experiment_id])
    assert len(found) == 1
    return client, found[0].info.run_id


def check_tracked_run(client: MlflowClient, run_id: str, run_dir: Path, tmp_path: Path) -> None:
    """Status, params, metrics and artifacts of a finished tiny run match what it wrote to its run dir."""
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "obs"
    params = run.data.params
    assert params["model.n_embd"] == "32" and params["train.max_steps"] == "20"
    assert params["data.sources.0.kind"] == "auto" and params["track.mlflow.enabled"] == "True"
    records = read_metrics(run_dir / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    loss = client.get_metric_history(run_id, "loss")
    assert [(m.step, m.value) for m in loss] == [(r["step"], pytest.approx(r["loss"])) for r in train]
    val = client.get_metric_history(run_id, "val_loss")
    assert [(m.step, m.value) for m in val] == [(r["step"], pytest.approx(r["val_loss"])) for r in evals]
    assert {"lr", "tokens", "tokens_per_second", "memory_gib", "val_ppl"} <= set(run.data.metrics)
    assert {a.path for a in client.list_artifacts(run_id)} == {"config.yaml", "meta.json"}
    meta = json.loads(Path(client.download_artifacts(run_id, "meta.json", str(tmp_path))).read_text())
    assert meta["status"] == "finished"  # written before the sinks finish, so the artifact says how it ended


@pytest.mark.slow
def test_sqlite_by_default(train_tiny: TrainTiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    # a value shaped like a token, in a field that is not a secret: it must still not reach MLflow
    result = train_tiny("track.mlflow.enabled=true", "eval.sample_prompt=hf_abcdefghijklmnopqrstuvwx")
    assert result.status == "finished"
    db = tmp_path / "runs" / "mlflow.db"
    assert db.is_file()
    client, run_id = only_run(f"sqlite:///{db}")
    check_tracked_run(client, run_id, Path(result.run_dir), tmp_path)
    assert client.get_run(run_id).data.params["eval.sample_prompt"] == "***"
    exp = client.get_experiment_by_name("kubetrain")
    assert exp is not None and exp.artifact_location == (tmp_path / "runs" / "mlartifacts").as_uri()


@pytest.fixture(scope="module")
def sqlite_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One store for the tests that drive the sink directly (creating its tables takes seconds)."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


def test_resumed_run_reuses_its_mlflow_run_and_status_follows(tmp_path: Path, sqlite_uri: str) -> None:
    uri = sqlite_uri
    cfg = load_config(None, None, ["run.name=res", "model.n_embd=32", "model.n_head=2"])
    info = {"run_dir": str(tmp_path / "res"), "run": "res", "start_step": 0, "params": 1000, "phase": "code",
            "config": cfg, "max_steps": 200, "restarts": 0, "world_size": 1}
    (tmp_path / "res").mkdir()
    first = MlflowSink(uri, "resume", stream=io.StringIO())
    first.start(info)
    first.log({"kind": "train", "step": 10, "loss": 3.0, "lr": 1e-3, "tokens": 640, "mfu": None, "time": 1.0})
    first.finish("stopped")
    client, run_id = only_run(uri, "resume")
    assert client.get_run(run_id).info.status == "KILLED"
    assert client.get_run(run_id).info.run_name == "res/code"

    second = MlflowSink(uri, "resume", stream=io.StringIO())
    second.start({**info, "start_step": 10, "restarts": 1})
    assert second.run_id == run_id and client.get_run(run_id).info.status == "RUNNING"
    second.log({"kind": "train", "step": 20, "loss": 2.0, "lr": 1e-3, "tokens": 1280, "time": 2.0})
    second.finish("failed")
    run = client.get_run(run_id)
    assert run.info.status == "FAILED"
    assert run.data.tags["kubetrain.restarts"] == "1" and run.data.tags["kubetrain.phase"] == "code"
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [10, 20]
    assert "mfu" not in run.data.metrics  # None is no measurement (no known peak FLOPS), not a zero


@pytest.mark.slow
def test_dead_tracking_server_does_not_stop_training(train_tiny: TrainTiny,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()  # nothing listens there
    result = train_tiny("track.mlflow.enabled=true", f"track.mlflow.tracking_uri=http://127.0.0.1:{port}")
    assert result.status == "finished" and result.steps == 20
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1
    assert "'mlflow'" in warnings[0] and f"http://127.0.0.1:{port}" in warnings[0]


def test_tracker_failure_mid_run_is_one_warning(tmp_path: Path, sqlite_uri: str) -> None:
    """A run deleted from the store mid-run: the fan-out switches MLflow off with one warning line."""
    warned: list[str] = []
    uri = sqlite_uri
    sink = MlflowSink(uri, "gone", stream=io.StringIO())
    cfg = load_config(None, None, [])
    fan = Fanout([sink], warn=warned.append)
    fan.start({"run_dir": str(tmp_path), "run": "gone", "config": cfg, "params": 1})
    client, run_id = only_run(uri, "gone")
    client.delete_run(run_id)  # logging to a deleted run is refused by the store
    fan.log({"kind": "train", "step": 1, "loss": 1.0, "time": 1.0})
    fan.log({"kind": "train", "step": 2, "loss": 1.0, "time": 1.0})
    fan.finish("finished")
    assert len(warned) == 1 and "'mlflow'" in warned[0] and "\n" not in warned[0]
    assert fan.sinks == []


def test_tracking_uri_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert tracking_uri(None, tmp_path) == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    assert tracking_uri(None, tmp_path) == "http://mlflow:5000"
    assert tracking_uri("postgresql://u@db/mlflow", tmp_path) == "postgresql://u@db/mlflow"
    assert default_artifact_location("http://mlflow:5000", tmp_path) is None
    assert default_artifact_location("postgresql://u@db/m", tmp_path) == (tmp_path / "mlartifacts").as_uri()


def _postgres_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(found[-1]).parent if found else None


@pytest.fixture(scope="module")
def postgres_uri() -> Iterator[str]:
    """A throwaway PostgreSQL server (initdb + pg_ctl on a free port); as root, it runs as a plain user."""
    bindir = _postgres_bin()
    if bindir is None:
        if os.environ.get("CI"):
            pytest.fail("PostgreSQL is not installed: apt-get install -y postgresql")
        pytest.skip("PostgreSQL is not installed (apt-get install -y postgresql)")
    base = Path(tempfile.mkdtemp(prefix="kubetrain-pg-", dir="/tmp"))
    as_user: list[str] = []
    if os.geteuid() == 0:  # postgres refuses to run as root
        user = next(u for u in ("postgres", "nobody") if _user_exists(u))
        entry = pwd.getpwnam(user)
        os.chown(base, entry.pw_uid, entry.pw_gid)
        as_user = ["runuser", "-u", user, "--"]
    port = free_port()
    data = base / "data"

    def pg(*args: str) -> None:
        subprocess.run([*as_user, *args], cwd=base, check=True, capture_output=True, timeout=120)

    pg(str(bindir / "initdb"), "-D", str(data), "-U", "kubetrain", "-A", "trust", "-E", "UTF8", "--no-sync")
    pg(str(bindir / "pg_ctl"), "-D", str(data), "-l", str(base / "server.log"), "-w", "-t", "60", "-o",
       f"-p {port} -k {base} -c listen_addresses=127.0.0.1 -c fsync=off", "start")
    try:
        import psycopg2

        conn = psycopg2.connect(host="127.0.0.1", port=port, user="kubetrain", dbname="postgres")
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute("CREATE DATABASE mlflow")
        conn.close()
        yield f"postgresql://kubetrain@127.0.0.1:{port}/mlflow"
    finally:
        pg(str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop")
        shutil.rmtree(base, ignore_errors=True)


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


@pytest.mark.slow
def test_postgresql_store(train_tiny: TrainTiny, postgres_uri: str, tmp_path: Path) -> None:
    result = train_tiny("track.mlflow.enabled=true", f"track.mlflow.tracking_uri={postgres_uri}")
    assert result.status == "finished"
    client, run_id = only_run(postgres_uri)
    check_tracked_run(client, run_id, Path(result.run_dir), tmp_path)


SECRET = "hf_" + "Qx9" * 8  # shaped like a Hugging Face token


@pytest.mark.slow
def test_config_artifact_and_config_yaml_hold_no_secret(train_tiny: TrainTiny, tmp_path: Path, sqlite_uri: str) -> None:
    """A token pasted into a free-text field: config.yaml on disk and the artifact MLflow stores both hide it."""
    result = train_tiny("track.mlflow.enabled=true", f"track.mlflow.tracking_uri={sqlite_uri}",
                        "track.mlflow.experiment=secrets", f"eval.sample_prompt=say {SECRET} twice")
    on_disk = (Path(result.run_dir) / "config.yaml").read_text()
    client, run_id = only_run(sqlite_uri, "secrets")
    stored = Path(client.download_artifacts(run_id, "config.yaml", str(tmp_path))).read_text()
    for text in (on_disk, stored):
        assert SECRET not in text
        config = yaml.safe_load(text)
        assert config["eval"]["sample_prompt"] == "say *** twice"
        assert config["model"]["n_embd"] == 32 and config["data"]["tokenizer"]["kind"] == "byte"
    assert client.get_run(run_id).data.params["eval.sample_prompt"] == "say *** twice"  # the same redaction
    for name in ("meta.json", "metrics.jsonl"):
        assert SECRET not in (Path(result.run_dir) / name).read_text()


def test_artifacts_are_redacted_even_when_the_run_files_are_not(tmp_path: Path, sqlite_uri: str) -> None:
    """A run directory an older kubetrain wrote (secrets on disk): what reaches MLflow is still redacted."""
    run_dir = tmp_path / "old"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"eval": {"sample_prompt": SECRET},
                                                         "data": {"tokenizer": {"path": "tok/v2"}}}))
    (run_dir / "meta.json").write_text(json.dumps({"argv": ["train", "--set", f"HF_TOKEN={SECRET}"],
                                                   "hf_token": "plain-but-secret", "status": "finished"}))
    sink = MlflowSink(sqlite_uri, "old-files", (tmp_path / "artifacts").as_uri(), stream=io.StringIO())
    sink.start({"run_dir": str(run_dir), "run": "old", "config": load_config(None, None, []), "params": 1})
    sink.finish("finished")
    client, run_id = only_run(sqlite_uri, "old-files")
    config = Path(client.download_artifacts(run_id, "config.yaml", str(tmp_path / "a"))).read_text()
    meta = Path(client.download_artifacts(run_id, "meta.json", str(tmp_path / "b"))).read_text()
    assert SECRET not in config and SECRET not in meta and "plain-but-secret" not in meta
    assert yaml.safe_load(config) == {"eval": {"sample_prompt": "***"}, "data": {"tokenizer": {"path": "tok/v2"}}}
    assert json.loads(meta) == {"argv": ["train", "--set", "HF_TOKEN=***"], "hf_token": "***", "status": "finished"}

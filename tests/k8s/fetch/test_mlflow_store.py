"""The job's MLflow store comes back with its run: a real SQLite store written by real training into a folder that
plays the claim, fetched over the local transport (the pod program as a local process, as in the simulate test),
then read here with MlflowClient."""

from __future__ import annotations

import hashlib
import json
import sqlite3
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from kubetrain.config import load_config
from kubetrain.k8s.fetch.mlflow_store import pod_store, relocate
from kubetrain.k8s.fetch.transfer import MANIFEST, FetchResult, LocalTransport, fetch_run
from kubetrain.train.trainer import train
from tests.track.conftest import TINY


def train_into(claim: Path, data_cache: Path, name: str, steps: int = 10) -> None:
    """`kubetrain train` (the real loop, in this process) with MLflow on its default store, into the claim."""
    sets = [*TINY, f"run.name={name}", f"run.output_dir={claim}", f"data.cache_dir={data_cache}",
            f"train.max_steps={steps}", "track.mlflow.enabled=true"]
    train(load_config(None, None, sets), argv=[], log=lambda _: None)  # resumes: --resume auto


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("data-cache")


@pytest.fixture
def claim(tmp_path: Path, data_cache: Path) -> Path:
    """The checkpoint claim's root (the pods' output dir): runs `obs` and `other`, one MLflow store beside them."""
    root = tmp_path / "claim"
    train_into(root, data_cache, "obs")
    train_into(root, data_cache, "other")
    return root


def fetch(claim: Path, local: Path) -> FetchResult:
    return fetch_run(LocalTransport(), str(claim / "obs"), local, "latest", mlflow_db=str(claim / "mlflow.db"))


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_id_of(store: Path, name: str) -> str:
    with sqlite3.connect(store) as con:
        return str(con.execute("SELECT run_uuid FROM runs WHERE name = ?", (name,)).fetchone()[0])


def test_the_store_and_this_runs_artifacts_work_here_without_the_claim(claim: Path, tmp_path: Path) -> None:
    before = digest(claim / "mlflow.db")
    obs, other = run_id_of(claim / "mlflow.db", "obs"), run_id_of(claim / "mlflow.db", "other")
    local = tmp_path / "laptop" / "runs" / "obs"
    result = fetch(claim, local)
    assert result.warnings == [] and result.mlflow_runs == [obs]
    assert result.mlflow_store == local / "mlflow" / "mlflow.db"
    assert digest(claim / "mlflow.db") == before  # the claim's store is only read
    artifacts = local / "mlflow" / "mlartifacts"
    assert sorted(p.name for p in artifacts.iterdir()) == [obs]  # not the other run's
    assert {f"mlflow/mlartifacts/{obs}/artifacts/config.yaml", "mlflow/mlflow.db"} <= set(result.copied)

    claim.rename(tmp_path / "claim-gone")  # what MLflow reads below can only come from the laptop's folder
    client = MlflowClient(f"sqlite:///{result.mlflow_store}")
    run = client.get_run(obs)
    assert run.info.status == "FINISHED" and run.info.artifact_uri == (artifacts / obs / "artifacts").as_uri()
    records = [json.loads(line) for line in (local / "metrics.jsonl").read_text().splitlines()]
    train_loss = [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]
    assert [(m.step, m.value) for m in client.get_metric_history(obs, "loss")] == [
        (step, pytest.approx(loss)) for step, loss in train_loss]
    downloaded = Path(client.download_artifacts(obs, "config.yaml", str(tmp_path / "dl")))
    assert "name: obs" in downloaded.read_text()
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.artifact_location == artifacts.as_uri()
    assert client.get_run(other).info.artifact_uri.startswith(artifacts.as_uri())  # its files stay on the claim


def test_a_second_fetch_copies_only_what_changed(claim: Path, tmp_path: Path, data_cache: Path) -> None:
    local = tmp_path / "local"
    fetch(claim, local)
    again = fetch(claim, local)
    assert again.copied == [] and again.nbytes == 0 and again.mlflow_runs == [run_id_of(claim / "mlflow.db", "obs")]
    assert "mlflow/mlflow.db" in json.loads((local / MANIFEST).read_text())

    train_into(claim, data_cache, "obs", steps=20)  # the job goes on: metrics and artifacts change
    obs = run_id_of(claim / "mlflow.db", "obs")
    third = fetch(claim, local)
    assert "mlflow/mlflow.db" in third.copied
    assert f"mlflow/mlartifacts/{obs}/artifacts/meta.json" in third.copied
    history = MlflowClient(f"sqlite:///{local / 'mlflow' / 'mlflow.db'}").get_metric_history(obs, "loss")
    assert max(m.step for m in history) == 20


def test_a_store_being_written_is_copied_as_committed(claim: Path, tmp_path: Path) -> None:
    """A job writing the store while it is read: the copy (SQLite's backup API in the pod) holds what is
    committed, also what still sits in the write-ahead log (a copy of mlflow.db alone would miss it), and not
    what an open transaction has written; it passes its integrity check."""
    writer = sqlite3.connect(claim / "mlflow.db", isolation_level=None)
    try:
        assert writer.execute("PRAGMA journal_mode=WAL").fetchone() == ("wal",)
        writer.execute("UPDATE runs SET name = 'committed' WHERE name = 'other'")  # into mlflow.db-wal
        assert (claim / "mlflow.db-wal").stat().st_size > 0
        writer.execute("BEGIN IMMEDIATE")
        writer.execute("UPDATE runs SET name = 'uncommitted' WHERE name = 'obs'")
        result = fetch(claim, tmp_path / "local")
        writer.execute("ROLLBACK")
    finally:
        writer.close()
    assert result.warnings == [] and result.mlflow_store is not None
    with sqlite3.connect(result.mlflow_store) as con:
        assert sorted(n for (n,) in con.execute("SELECT name FROM runs")) == ["committed", "obs"]
        assert con.execute("PRAGMA integrity_check").fetchone() == ("ok",)


def test_a_run_with_phases_brings_each_phases_artifacts(tmp_path: Path, data_cache: Path) -> None:
    from kubetrain.train.phases import train_all

    claim = tmp_path / "claim"
    phases = '[{"name": "a", "train": {"max_steps": 2}}, {"name": "b", "train": {"max_steps": 2}}]'
    sets = [*TINY, "run.name=obs", f"run.output_dir={claim}", f"data.cache_dir={data_cache}",
            "track.mlflow.enabled=true", "checkpoint.every_steps=2", "eval.every_steps=2", f"phases={phases}"]
    train_all(load_config(None, None, sets), argv=[], log=lambda _: None)
    train_into(claim, data_cache, "other", steps=2)
    result = fetch(claim, tmp_path / "local")
    with sqlite3.connect(claim / "mlflow.db") as con:
        ids = [r for (r,) in con.execute("SELECT run_uuid FROM runs WHERE name LIKE 'obs/%' ORDER BY start_time")]
    assert len(ids) == 2 and result.mlflow_runs == ids and result.warnings == []
    assert sorted(p.name for p in (tmp_path / "local" / "mlflow" / "mlartifacts").iterdir()) == sorted(ids)


def test_a_store_that_is_not_there_yet(tmp_path: Path) -> None:
    run = tmp_path / "claim" / "obs"
    run.mkdir(parents=True)
    (run / "meta.json").write_text("{}")
    result = fetch(tmp_path / "claim", tmp_path / "local")
    assert result.mlflow_store is None and result.copied == ["meta.json"]
    assert result.warnings == [f"MLflow: no store at {tmp_path / 'claim' / 'mlflow.db'} (the job has not logged to "
                               "it yet)"]


@pytest.mark.parametrize(("sets", "store", "line"), [
    ([], None, None),
    (["track.mlflow.enabled=true"], "/checkpoints/mlflow.db", None),
    (["track.mlflow.enabled=true", "track.mlflow.tracking_uri=sqlite:////checkpoints/track/ml.db"],
     "/checkpoints/track/ml.db", None),
    (["track.mlflow.enabled=true", "track.mlflow.tracking_uri=sqlite:////tmp/ml.db"], None,
     "MLflow: the job's store /tmp/ml.db is not on the checkpoint claim (/checkpoints/): not fetched"),
    (["track.mlflow.enabled=true", "track.mlflow.tracking_uri=https://mlflow.example.com"], None,
     "MLflow: the job tracks to https://mlflow.example.com: its data stays on that server"),
    (["track.mlflow.enabled=true", "track.mlflow.tracking_uri=postgresql://ml@db.example.com/mlflow"], None,
     "MLflow: the job tracks to postgresql://ml@db.example.com/mlflow: its data stays on that server"),
    (["track.mlflow.enabled=true", 'k8s.env={"MLFLOW_TRACKING_URI": "http://mlflow:5000"}'], None,
     "MLflow: the job tracks to http://mlflow:5000: its data stays on that server"),
    (["track.mlflow.enabled=true", 'k8s.secrets.env={"MLFLOW_TRACKING_URI": {"name": "ml", "key": "uri"}}'], None,
     "MLflow: the job's tracking URI comes from a Secret (k8s.secrets.env MLFLOW_TRACKING_URI): its data stays "
     "where that URI points"),
])
def test_which_store_is_on_the_claim(sets: list[str], store: str | None, line: str | None) -> None:
    assert pod_store(load_config(None, None, sets), "/checkpoints") == (store, line)


def test_only_locations_under_the_pods_output_dir_move(tmp_path: Path) -> None:
    here = tmp_path / "mlflow"
    bases = ["/checkpoints"]
    assert relocate("file:///checkpoints/mlartifacts/r1/artifacts", bases, here) == \
        (here / "mlartifacts" / "r1" / "artifacts").as_uri()
    assert relocate("/checkpoints/mlartifacts", bases, here) == str(here / "mlartifacts")
    assert relocate("file:///checkpoints-other/x", bases, here) is None
    assert relocate("/app/mlruns/0", bases, here) is None  # the Default experiment, in the pod's working dir
    assert relocate("s3://bucket/mlartifacts", bases, here) is None

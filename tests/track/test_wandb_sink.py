"""Weights & Biases: real offline runs of the real `wandb`, read back with wandb's own reader (`wandb leet inspect
--json`, which parses the run's .wandb transaction log), and a W&B server that is down.

wandb starts a service process on its first run (seconds), so the runs here are few and marked slow.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import wandb

from kubetrain.config import load_config
from kubetrain.runs.reader import read_meta, read_metrics
from kubetrain.track import Fanout
from kubetrain.track.wandb_sink import WandbSink, resolve_mode

from .conftest import TrainTiny

API_KEY = "0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c"  # the shape of a W&B key (40 hex digits); reaches no server


@pytest.fixture
def wandb_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Offline W&B whose every folder (settings, cache, artifact staging) is inside tmp_path: no network, and
    nothing of the user's own W&B set-up is read or written. wandb reads its environment once per session and
    ignores later changes, so each test ends the session (wandb.teardown) and the next reads its own."""
    home = tmp_path / "wandb-home"
    for name in ("WANDB_DIR", "WANDB_BASE_URL", "WANDB_ENTITY", "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_API_KEY", API_KEY)  # set, so the test sees that it is written nowhere
    for name in ("CONFIG", "CACHE", "DATA"):
        monkeypatch.setenv(f"WANDB_{name}_DIR", str(home / name.lower()))
    yield home
    wandb.teardown()


def inspect(run_folder: Path, *flags: str) -> Any:
    """wandb's own reading of an offline run's .wandb file: its records (--json) or its state (--summary)."""
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", *flags, str(run_folder)],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return json.loads(out) if flags else [json.loads(line) for line in out.splitlines() if line.strip()]


def history(records: list[dict[str, Any]], metric: str) -> list[tuple[int, float]]:
    rows = [r["history"]["item"] for r in records if r["type"] == "history"]
    return [(row["step"], row[metric]) for row in rows if metric in row]


def synced(parts: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The history W&B holds after `wandb sync` of a run's offline parts in order: a part that rewinds the run (its
    branch point) keeps the rows up to and including that step, then appends its own."""
    rows: list[dict[str, Any]] = []
    for records in parts:
        run = next(r["run"] for r in records if r["type"] == "run")
        if run.get("branch_point"):
            rows = [r for r in rows if r["history"]["item"]["_step"] <= run["branch_point"]["value"]]
        rows += [r for r in records if r["type"] == "history"]
    return rows


def offline_runs(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "wandb").glob("offline-run-*"))


@pytest.mark.slow
def test_offline_run_read_back_and_a_resume_continues_the_same_run(train_tiny: TrainTiny, wandb_home: Path) -> None:
    on = ["track.wandb.enabled=true", "track.wandb.log_checkpoints=true", "track.wandb.tags=[tiny]",
          "eval.sample_prompt=say hf_abcdefghijklmnopqrstuvwx"]  # a token-shaped value where no secret belongs
    first = train_tiny(*on, "train.max_steps=10")
    run_dir = Path(first.run_dir)
    run_id = read_meta(run_dir)["trackers"]["wandb"]["id"]
    [folder] = offline_runs(run_dir)
    state = inspect(folder, "--summary")
    assert (state["run_id"], state["project"], state["tags"], state["exit_code"]) == (run_id, "kubetrain", ["tiny"], 0)
    config = state["config"]
    assert config["model"]["n_embd"] == 32 and config["track"]["wandb"]["enabled"] is True
    assert config["eval"]["sample_prompt"] == "say ***"
    assert (config["kubetrain"]["max_steps_resolved"], config["kubetrain"]["world_size"]) == (10, 1)
    samples = [json.loads(line) for line in (run_dir / "samples.txt").read_text().splitlines()]
    assert (state["summary"]["sample"], state["summary"]["sample_step"]) == (samples[-1]["sample"], 10)
    records = inspect(folder)
    [artifact] = [r["artifact"] for r in records if r["type"] == "artifact"]  # checkpoint.every_steps=10
    assert artifact["type"] == "model" and {"latest", "step-000010"} <= set(artifact["aliases"])
    saved = {p.name for p in (run_dir / "checkpoints" / "step-000010").iterdir()}
    assert {entry["path"] for entry in artifact["manifest"]["contents"]} == saved

    second = train_tiny(*on)  # train.max_steps=20: resumes from step 10
    assert second.status == "finished" and second.steps == 20
    assert read_meta(run_dir)["trackers"]["wandb"]["id"] == run_id
    folders = offline_runs(run_dir)
    assert len(folders) == 2 and folder in folders
    resumed = inspect(next(f for f in folders if f != folder))
    run_record = next(r["run"] for r in resumed if r["type"] == "run")
    # `wandb sync` rewinds that run to the checkpoint the resume started from, and appends from there
    assert run_record["run_id"] == run_id
    assert (run_record["branch_point"]["run"], run_record["branch_point"]["value"]) == (run_id, 10)
    # the two parts together hold every line of metrics.jsonl, each once
    metrics = read_metrics(run_dir / "metrics.jsonl")
    for kind, name in (("train", "loss"), ("eval", "val_loss")):
        logged = history(synced([records, resumed]), f"{kind}/{name}")
        assert logged == [(r["step"], pytest.approx(r[name])) for r in metrics if r["kind"] == kind]
    assert [step for step, _ in history(resumed, "train/loss")] == [15, 20]

    # a crash after step 20 but before its checkpoint was complete: the next start resumes from step 10 and trains
    # steps 11-20 again; W&B shows each step once, with the values of the run that went on
    shutil.rmtree(run_dir / "checkpoints" / "step-000020")
    third = train_tiny(*on)
    assert third.status == "finished" and third.steps == 20
    [again] = [f for f in offline_runs(run_dir) if f not in folders]
    parts = [records, resumed, inspect(again)]
    metrics = read_metrics(run_dir / "metrics.jsonl")
    for kind, name in (("train", "loss"), ("eval", "val_loss")):
        logged = history(synced(parts), f"{kind}/{name}")
        assert logged == [(r["step"], pytest.approx(r[name])) for r in metrics if r["kind"] == kind]
    # the key from the environment is in no file of the run: not in W&B's logs, config or transaction log
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert API_KEY.encode() not in path.read_bytes(), path


@pytest.mark.ci  # minutes of processes together with its peers: .ci/run runs it, not the README's test command
@pytest.mark.slow
def test_a_phase_is_a_run_of_its_group_and_a_stop_is_a_preemption(tmp_path: Path, wandb_home: Path) -> None:
    run_dir = tmp_path / "big" / "phases" / "code"
    run_dir.mkdir(parents=True)
    sink = WandbSink("p", tags=["t"], stream=io.StringIO())
    sink.start({"run_dir": str(run_dir), "run": "big", "phase": "code", "config": load_config(None, None, []),
                "params": 1, "start_step": 0})
    sink.log({"kind": "train", "step": 3, "loss": 1.25, "lr": 0.1, "mfu": None, "phase": "code"})
    sink.finish("stopped")  # SIGTERM after a checkpoint: resumable
    [folder] = offline_runs(run_dir)
    records = inspect(folder)
    run = next(r["run"] for r in records if r["type"] == "run")
    assert (run["display_name"], run["run_group"], run["job_type"]) == ("big/code", "big", "code")
    assert history(records, "train/loss") == [(3, 1.25)]
    assert not history(records, "train/mfu")  # None is no measurement, not a zero
    assert any(r["type"] == "preempting" for r in records)
    assert next(r["exit"] for r in records if r["type"] == "exit")["exit_code"] == 75


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.ci  # minutes of processes together with its peers: .ci/run runs it, not the README's test command
@pytest.mark.slow
def test_a_w_and_b_server_that_is_down_does_not_stop_training(
        train_tiny: TrainTiny, wandb_home: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("WANDB_MODE")  # auto: online, since WANDB_API_KEY is set
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "5")  # wandb's own setting (default 90 s)
    result = train_tiny("track.wandb.enabled=true")
    assert result.status == "finished" and result.steps == 20
    metrics = read_metrics(Path(result.run_dir) / "metrics.jsonl")
    assert [r["step"] for r in metrics if r["kind"] == "train"] == [5, 10, 15, 20]
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "'wandb'" in warnings[0] and "online" in warnings[0]
    assert os.environ["WANDB_BASE_URL"] in warnings[0]  # which server was down
    assert API_KEY not in warnings[0]


def test_a_folder_it_cannot_write_switches_it_off_with_one_warning(
        tmp_path: Path, wandb_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")  # a file where W&B's folder should be: no user (root neither) can create it
    monkeypatch.setenv("WANDB_DIR", str(blocker))
    (tmp_path / "run").mkdir()
    warned: list[str] = []
    fan = Fanout([WandbSink("p", stream=io.StringIO())], warn=warned.append)
    fan.start({"run_dir": str(tmp_path / "run"), "run": "r", "config": load_config(None, None, []), "params": 1})
    fan.log({"kind": "train", "step": 1, "loss": 1.0})
    fan.finish("finished")
    assert fan.sinks == [] and len(warned) == 1
    assert "'wandb'" in warned[0] and str(blocker) in warned[0] and "\n" not in warned[0]


def test_auto_mode_is_online_only_with_a_key() -> None:
    assert resolve_mode("auto", {}) == ("offline", "no WANDB_API_KEY")
    assert resolve_mode("auto", {"WANDB_API_KEY": API_KEY}) == ("online", "WANDB_API_KEY is set")
    assert resolve_mode("auto", {"WANDB_API_KEY": API_KEY, "WANDB_MODE": "offline"})[0] == "offline"
    assert resolve_mode("online", {}) == ("online", "track.wandb.mode")  # a `wandb login` holds the key
    assert resolve_mode("disabled", {"WANDB_MODE": "online"})[0] == "disabled"

"""`kubetrain runs list/show`: status, step, tokens, best val loss, latest checkpoint, phase."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kubetrain import runs
from kubetrain.runs.reader import describe_run, list_runs
from tests.train.conftest import kubetrain, sets


def test_failed_status_when_the_process_is_gone(tmp_path: Path) -> None:
    run = tmp_path / "crashed"
    run.mkdir()
    import os
    import socket

    (run / "meta.json").write_text(json.dumps({"status": "running", "host": socket.gethostname(),
                                               "pid": 2**22 + 12345, "step": 3}))
    assert os.uname().nodename == socket.gethostname()
    assert describe_run(run)["status"] == "failed"
    (run / "meta.json").write_text(json.dumps({"status": "running", "host": socket.gethostname(),
                                               "pid": os.getpid(), "step": 3}))
    assert describe_run(run)["status"] == "running"
    assert list_runs(tmp_path)[0]["name"] == "crashed"
    assert list_runs(tmp_path / "none") == []


@pytest.mark.slow
def test_runs_list_and_show(tmp_path: Path) -> None:
    kubetrain("train", *sets("run.name=a", "train.max_steps=4", "eval.every_steps=2"), cwd=tmp_path)
    listed = json.loads(kubetrain("runs", "list", "runs", "--json", cwd=tmp_path).stdout)
    assert [r["name"] for r in listed] == ["a"]
    row = listed[0]
    assert row["status"] == "finished" and row["step"] == 4 and row["tokens"] == 4 * 4 * 32
    assert row["latest"] == "step-000004" and row["best_val_loss"] is not None
    shown = json.loads(kubetrain("runs", "show", "runs/a", "--json", cwd=tmp_path).stdout)
    assert shown["checkpoints"][-1] == "step-000004"
    table = kubetrain("runs", "list", "runs", cwd=tmp_path).stdout
    assert "finished" in table and "step-000004" in table
    text = kubetrain("runs", "show", "runs/a", cwd=tmp_path).stdout
    assert "status: finished" in text
    bad = kubetrain("runs", "show", "runs/zzz", cwd=tmp_path, check=False)
    assert bad.returncode == 2 and bad.stderr.strip() == "error: no such run directory: runs/zzz"
    assert runs.read_meta(tmp_path / "runs" / "a")["world_size"] == 1


def _preflight(ok: bool) -> dict[str, object]:
    problems = [] if ok else ["rank 1 (pod job-1, node gpu-b): all-reduce 0.9 GB/s, median 11.8 GB/s"]
    return {"world_size": 2, "backend": "nccl", "seconds": 3.5, "median_all_reduce_busbw": 11.8e9,
            "median_link_bandwidth": 20e9, "links": [{"ranks": [0, 1], "bandwidth": 20e9}],
            "verdict": {"ok": ok, "problems": problems, "warnings": [], "named_ranks": [] if ok else [1]}}


def test_a_job_the_preflight_stopped_is_a_failed_run_that_names_the_rank(tmp_path: Path) -> None:
    run = tmp_path / "stopped"
    run.mkdir()
    (run / runs.PREFLIGHT_FILE).write_text(json.dumps(_preflight(ok=False)))  # all it wrote before step 1
    info = describe_run(run)
    assert info["status"] == "failed" and info["preflight"]["ok"] is False
    assert info["preflight"]["problems"] == _preflight(ok=False)["verdict"]["problems"]  # type: ignore[index]
    # `runs list` shows it too, with its state: the job's one record is that the preflight stopped it
    [listed] = runs.list_runs(tmp_path)
    assert (listed["name"], listed["status"], listed["preflight"]["ok"]) == ("stopped", "failed", False)


def test_every_phase_of_a_run_reads_the_jobs_one_preflight(tmp_path: Path) -> None:
    run = tmp_path / "phased"
    (run / runs.PHASES / "code").mkdir(parents=True)
    (run / runs.PREFLIGHT_FILE).write_text(json.dumps(_preflight(ok=True)))
    assert runs.read_preflight(run / runs.PHASES / "code")["seconds"] == 3.5
    assert runs.read_preflight(tmp_path) == {}

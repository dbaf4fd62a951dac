"""`kubetrain runs sync`: a run directory pushed to a real S3-compatible server and pulled back, changed files only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kubetrain import checkpoint
from kubetrain.checkpoint.store import open_store
from kubetrain.checkpoint.sync import MANIFEST, _in_order, pull, push, sync_run
from kubetrain.errors import CheckpointError, UserInputError
from tests.conftest import Cli, RunMain
from tests.object_store import Bucket


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _fake_run(root: Path) -> Path:
    (root / "checkpoints").mkdir(parents=True)
    (root / "meta.json").write_text(json.dumps({"status": "finished", "step": 2}))
    (root / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 1.0}\n')
    for step in (1, 2):
        checkpoint.save(root / "checkpoints", step, {"w": torch.full((8, 8), float(step))}, {"s": step},
                        {"tokens": step}, keep_last=5)
    (root / "checkpoints" / "step-000003.tmp").mkdir()  # a save in progress: never copied
    (root / "checkpoints" / "step-000003.tmp" / "model.safetensors").write_bytes(b"half")
    return root


def test_push_copies_only_what_changed_and_pull_restores_it(bucket: Bucket, tmp_path: Path) -> None:
    run = _fake_run(tmp_path / "run")
    store = open_store(f"{bucket.uri}/run", bucket.endpoint)
    first = push(run, store)
    assert first.unchanged == 0 and "checkpoints/step-000003.tmp/model.safetensors" not in first.copied
    again = push(run, store)
    assert again.copied == [] and again.unchanged == len(first.copied)
    (run / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 2.0}\n')  # same size, new bytes
    assert push(run, store).copied == ["metrics.jsonl"]

    back = tmp_path / "back"
    pulled = pull(store, back)
    assert sorted(pulled.copied) == sorted(first.copied)
    expected = {k: v for k, v in _files(run).items() if ".tmp" not in k}
    assert _files(back) == expected
    assert checkpoint.find_resumable(back / "checkpoints") is not None
    assert pull(store, back).copied == []


def test_pull_refuses_a_file_that_does_not_match_its_checksum(bucket: Bucket, tmp_path: Path) -> None:
    run = _fake_run(tmp_path / "run")
    store = open_store(f"{bucket.uri}/run", bucket.endpoint)
    push(run, store)
    back = tmp_path / "back"
    pull(store, back)
    model = "checkpoints/step-000002/model.safetensors"
    bad = bytearray((back / model).read_bytes())
    bad[-1] ^= 0xFF
    bucket.fs.pipe_file(bucket.path(f"run/{model}"), bytes(bad))  # corrupt in the bucket
    (back / model).write_bytes(b"x" * len(bad))  # and changed here, so pull wants to replace it
    with pytest.raises(CheckpointError, match="does not match its recorded checksum"):
        pull(store, back)
    assert (back / model).read_bytes() == b"x" * len(bad)
    assert not [p for p in back.rglob("*.tmp")]


def test_checkpoint_meta_and_pointers_are_copied_last() -> None:
    rels = ["checkpoints/latest", "checkpoints/step-000002/meta.json", "meta.json", "checkpoints/best",
            "checkpoints/step-000002/model.safetensors", "metrics.jsonl"]
    assert _in_order(rels) == [
        ["checkpoints/step-000002/model.safetensors", "meta.json", "metrics.jsonl"],
        ["checkpoints/step-000002/meta.json"],
        ["checkpoints/best", "checkpoints/latest"],
    ]


def test_a_plain_path_is_a_store_too(tmp_path: Path) -> None:
    run = _fake_run(tmp_path / "run")
    result = sync_run(str(run), str(tmp_path / "backup"))
    assert result.direction == "push" and (tmp_path / "backup" / MANIFEST).is_file()
    assert checkpoint.find_resumable(tmp_path / "backup" / "checkpoints") is not None


def test_bad_arguments_are_one_error_line(run_main: RunMain, tmp_path: Path) -> None:
    code, _, err = run_main("runs", "sync", "s3://a/x", "s3://b/y")
    assert code == 2
    assert err.strip() == "error: runs sync copies between a run directory and a URI; both arguments are URIs"
    code, _, err = run_main("runs", "sync", str(tmp_path / "missing"), "s3://b/y")
    assert code == 2 and err.strip() == f"error: no such run directory: {tmp_path / 'missing'}"
    with pytest.raises(UserInputError, match="nothing to pull"):
        pull(open_store(str(tmp_path / "empty-store")), tmp_path / "x")


@pytest.mark.slow
def test_a_trained_run_round_trips_through_the_bucket(bucket: Bucket, cli: Cli, tiny_args: list[str],
                                                      tmp_cwd: Path) -> None:
    trained = cli("train", *tiny_args, "--set", "run.name=r")
    assert trained.returncode == 0, trained.stderr
    uri = f"{bucket.uri}/r"
    pushed = cli("runs", "sync", "runs/r", uri, "--endpoint-url", bucket.endpoint)
    assert pushed.returncode == 0, pushed.stderr
    assert pushed.stdout.startswith("pushed ") and pushed.stdout.rstrip().endswith("0 unchanged")
    again = cli("runs", "sync", "runs/r", uri, "--endpoint-url", bucket.endpoint)
    assert again.stdout.startswith("pushed 0 files")
    pulled = cli("runs", "sync", uri, "restored/r", "--endpoint-url", bucket.endpoint)
    assert pulled.returncode == 0, pulled.stderr
    assert pulled.stdout.startswith("pulled ")
    shown = [json.loads(cli("runs", "show", d, "--json").stdout) for d in ("runs/r", "restored/r")]
    for info in shown:
        info.pop("path")
    assert shown[0] == shown[1] and shown[0]["status"] == "finished" and shown[0]["checkpoints"]
    assert _files(tmp_cwd / "restored" / "r") == {k: v for k, v in _files(tmp_cwd / "runs" / "r").items()}

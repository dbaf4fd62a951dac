"""`kubetrain runs sync`: a run directory pushed to a real S3 server (SeaweedFS) and pulled back, changed files only;
a store whose keys would land outside the run directory, or that denies reads, is one error line and no file."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import torch

from kubetrain import checkpoint
from kubetrain.checkpoint.store import open_store
from kubetrain.checkpoint.sync import MANIFEST, _in_order, pull, push, sync_run
from kubetrain.errors import CheckpointError, UserInputError
from tests.conftest import Cli, RunMain
from tests.object_store import WRITER, Bucket, use_credentials


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


def test_a_file_uri_with_three_slashes_is_the_path_it_names(tmp_path: Path, run_main: RunMain) -> None:
    """file:///PATH, the form the refusal itself offers, and file://localhost/PATH are the path (RFC 8089)."""
    run = _fake_run(tmp_path / "run")
    code, _, err = run_main("runs", "sync", str(run), f"file://{tmp_path}/backup")
    assert code == 0, err
    assert (tmp_path / "backup" / MANIFEST).is_file()
    code, _, err = run_main("runs", "sync", f"file://localhost{tmp_path}/backup", f"file://{tmp_path}/back")
    assert code == 0, err
    assert checkpoint.find_resumable(tmp_path / "back" / "checkpoints") is not None


def test_a_file_uri_with_a_host_is_refused_and_writes_nothing(tmp_path: Path, run_main: RunMain,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """file://tmp/x names the host `tmp`: never the folder ./tmp/x under wherever the command ran."""
    run = _fake_run(tmp_path / "run")
    monkeypatch.chdir(tmp_path)
    code, _, err = run_main("runs", "sync", str(run), "file://tmp/x")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "host 'tmp'" in err and "file:///PATH" in err
    assert not (tmp_path / "tmp").exists()


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


def _everything(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.mark.parametrize("key", ["../evil", "checkpoints/../../evil", "a/../../../evil", "/abs/evil", "a//b"])
def test_pull_refuses_a_store_that_lists_a_key_outside_the_run_directory(
    run_main: RunMain, tmp_path: Path, key: str
) -> None:
    uri = f"memory://kt-{uuid.uuid4().hex[:8]}/run"  # fsspec's memory store keeps any key, as S3 does
    store = open_store(uri)
    store.fs.pipe_file(f"{store.root}/metrics.jsonl", b"{}\n")
    store.fs.pipe_file(f"{store.root}/{key}", b"pwned")
    assert key in store.sizes()
    work = tmp_path / "work"
    (work / "runs").mkdir(parents=True)
    code, out, err = run_main("runs", "sync", uri, str(work / "runs" / "r"))
    assert code == 2 and out == ""
    assert err.strip() == (f"error: {uri} lists {key!r}, which would land outside {work / 'runs' / 'r'} "
                           f"({err.split('(')[-1].split(')')[0]}); nothing was pulled")
    assert _everything(work) == {"runs"}


def test_pull_refuses_a_run_folder_whose_link_leads_outside(tmp_path: Path) -> None:
    run = _fake_run(tmp_path / "run")
    store = open_store(str(tmp_path / "backup"))
    push(run, store)
    back, elsewhere = tmp_path / "back", tmp_path / "elsewhere"
    back.mkdir()
    elsewhere.mkdir()
    (back / "checkpoints").symlink_to(elsewhere)  # pulled into, its checkpoints would land in `elsewhere`
    with pytest.raises(UserInputError, match=r"'checkpoints/\S+', which would land outside .*through a link"):
        pull(store, back)
    assert list(elsewhere.iterdir()) == [] and _everything(back) == {"checkpoints"}


def test_pull_with_credentials_that_may_not_read_is_one_line_and_writes_nothing(
    bucket: Bucket, run_main: RunMain, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    push(_fake_run(tmp_path / "run"), open_store(f"{bucket.uri}/run", bucket.endpoint))
    use_credentials(monkeypatch, WRITER)  # Write and List only
    code, out, err = run_main("runs", "sync", f"{bucket.uri}/run", str(tmp_path / "back"), "--endpoint-url",
                              bucket.endpoint)
    assert code == 1 and out == "", err
    assert err.startswith(f"error: cannot sync with {bucket.uri}/run: ") and "denied" in err.lower(), err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "back").exists()

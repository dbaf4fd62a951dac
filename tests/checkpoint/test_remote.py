"""Checkpoints in object storage, against a real S3 server (SeaweedFS, over HTTP through s3fs)."""

from __future__ import annotations

import gc
import json
import socket
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kubetrain import checkpoint
from kubetrain.checkpoint import remote, restore, verdict
from kubetrain.config.schema import Config
from kubetrain.errors import CheckpointError
from tests.object_store import ADMIN, Bucket, S3Server, free_port, start_server, use_credentials


def _cfg(uri: str, endpoint: str, **section: object) -> Config:
    return Config.model_validate({"run": {"name": "r"},
                                  "checkpoint": {"uri": uri, "endpoint_url": endpoint, **section}})


def _save(root: Path, step: int, *, best: bool = False, keep_last: int = 100) -> checkpoint.Checkpoint:
    gen = torch.Generator().manual_seed(step)
    return checkpoint.save(root, step, {"w": torch.randn(64, 64, generator=gen)},
                           {"state": {"step": step}, "exp_avg": torch.randn(256, generator=gen)},
                           {"tokens": step}, keep_last=keep_last, is_best=best)


def _names(bucket: Bucket, rel: str) -> list[str]:
    """The files and the folders that hold files directly under `rel` (by the files: SeaweedFS still lists a
    folder whose objects were all deleted as a prefix, where AWS lists nothing)."""
    top = bucket.path(rel) + "/"
    return sorted({p.removeprefix(top).split("/", 1)[0] for p in bucket.fs.find(top)})


def test_uploads_files_then_pointers_and_keeps_last_in_the_bucket(bucket: Bucket, tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    lines: list[str] = []
    uploader = remote.Uploader.from_config(_cfg(bucket.uri, bucket.endpoint, keep_last=2), None, root, lines.append)
    assert uploader is not None
    local_bytes = {}
    for step in (1, 2, 3, 4):
        # keep_last=1 locally: each save prunes the previous checkpoint while its upload may still be queued
        saved = _save(root, step, best=step == 2, keep_last=1)
        local_bytes[saved.path.name] = (saved.path / checkpoint.MODEL_FILE).read_bytes()
        uploader.submit(saved, is_best=step == 2)
    uploader.close()
    assert lines == [f"checkpoints uploaded to {bucket.uri}/r/checkpoints (latest: step-000004)"]
    assert _names(bucket, "r/checkpoints") == ["best", "latest", "step-000002", "step-000003", "step-000004"]
    assert bucket.fs.cat_file(bucket.path("r/checkpoints/latest")) == b"step-000004\n"
    assert bucket.fs.cat_file(bucket.path("r/checkpoints/best")) == b"step-000002\n"
    for name in ("step-000002", "step-000003", "step-000004"):
        assert bucket.fs.cat_file(bucket.path(f"r/checkpoints/{name}/model.safetensors")) == local_bytes[name]
        assert _names(bucket, f"r/checkpoints/{name}") == ["meta.json", "model.safetensors", "trainer.pt",
                                                           "trainer.safetensors"]
    assert not (root / remote.STAGING).exists()


def test_restore_skips_unfinished_and_corrupt_uploads(bucket: Bucket, tmp_path: Path) -> None:
    cfg = _cfg(bucket.uri, bucket.endpoint)
    store = remote.checkpoint_store(cfg)
    assert store is not None
    source = tmp_path / "source"
    for step in (3, 12, 6):
        remote.upload(store, _save(source, step).path, checkpoint.step_name(step), is_best=step == 3, keep_last=5)
    # step 6: same size, other bytes; step 9: its data files arrived, its meta.json never did; step 12: a file
    # was lost
    bucket.fs.rm(bucket.path("r/checkpoints/step-000012/trainer.pt"))
    model6 = bucket.path("r/checkpoints/step-000006/model.safetensors")
    data = bytearray(bucket.fs.cat_file(model6))
    data[-1] ^= 0xFF
    bucket.fs.pipe_file(model6, bytes(data))
    bucket.fs.pipe_file(bucket.path("r/checkpoints/step-000009/model.safetensors"), b"partial")

    root = tmp_path / "run" / "checkpoints"
    lines: list[str] = []
    restored = restore.restore_newest(cfg, None, root, lines.append)
    assert restored is not None and restored.step == 3
    assert lines == [  # `latest` (step 6, uploaded last) first, then the others newest first
        f"warning: skipping {bucket.uri}/r/checkpoints/step-000006: model.safetensors fails its checksum",
        f"warning: skipping {bucket.uri}/r/checkpoints/step-000012: trainer.pt is missing",
        f"warning: skipping {bucket.uri}/r/checkpoints/step-000009: its upload did not finish (no meta.json)",
        f"restored step-000003 from {bucket.uri}/r/checkpoints",
    ]
    assert sorted(p.name for p in root.iterdir()) == [".verified", "best", "latest", "step-000003"]
    assert verdict.recorded(root / "step-000003", restored.meta["files"]) == (True, None)  # hashed as it arrived
    assert checkpoint.find_resumable(root) is not None
    for f in ("model.safetensors", "trainer.pt", "trainer.safetensors", "meta.json"):
        assert (root / "step-000003" / f).read_bytes() == (source / "step-000003" / f).read_bytes()
    # a local checkpoint wins: nothing is downloaded
    assert restore.restore_newest(cfg, None, root, lines.append) is None


def test_an_empty_store_restores_nothing(bucket: Bucket, tmp_path: Path) -> None:
    lines: list[str] = []
    assert restore.restore_newest(_cfg(bucket.uri, bucket.endpoint), None, tmp_path / "c", lines.append) is None
    assert lines == []


def test_a_store_whose_every_checkpoint_is_damaged_stops_the_run(bucket: Bucket, tmp_path: Path) -> None:
    cfg = _cfg(bucket.uri, bucket.endpoint)
    store = remote.checkpoint_store(cfg)
    assert store is not None
    remote.upload(store, _save(tmp_path / "source", 4).path, "step-000004", is_best=False, keep_last=5)
    bucket.fs.rm(bucket.path("r/checkpoints/step-000004/trainer.pt"))
    with pytest.raises(CheckpointError, match=f"none of the 1 checkpoints in {bucket.uri}/r/checkpoints verifies"):
        restore.restore_newest(cfg, None, tmp_path / "run" / "checkpoints", lambda m: None)


def test_a_store_down_for_the_first_tries_is_read_when_it_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_credentials(monkeypatch, ADMIN)
    port = free_port()
    uri, endpoint = "s3://kt-late/store", f"http://127.0.0.1:{port}"
    cfg = _cfg(uri, endpoint, restore_attempts=5, restore_backoff_seconds=0.1)
    servers: list[S3Server] = []
    lines: list[str] = []

    def log(line: str) -> None:
        lines.append(line)
        if "attempt 2 of 5" in line:  # the store comes up, with a checkpoint in it, after two failed tries
            servers.append(start_server(port, tmp_path))
            bucket = remote.checkpoint_store(cfg)
            assert bucket is not None
            bucket.fs.mkdir("kt-late")
            remote.upload(bucket, _save(tmp_path / "source", 7).path, "step-000007", is_best=True, keep_last=5)

    try:
        restored = restore.restore_newest(cfg, None, tmp_path / "run" / "checkpoints", log)
    finally:
        for server in servers:
            server.stop()
    assert restored is not None and restored.step == 7
    assert [line.split(":", 1)[0] for line in lines] == ["warning", "warning", "restored step-000007 from s3"]
    assert f"cannot read checkpoints from {uri}/r/checkpoints (attempt 1 of 5)" in lines[0]
    assert lines[1].endswith("trying again in 0.2 s")


def test_a_missing_bucket_is_not_an_empty_store(bucket: Bucket, tmp_path: Path) -> None:
    cfg = _cfg(f"s3://kt-{uuid.uuid4().hex[:12]}/store", bucket.endpoint, restore_attempts=1)
    with pytest.raises(CheckpointError, match=r"\(1 attempts\): bucket kt-\w+ does not exist; the local folder"):
        restore.restore_newest(cfg, None, tmp_path / "c", lambda m: None)


@pytest.fixture(params=["unreachable", "wrong-secret"])
def bad_store(request: pytest.FixtureRequest, bucket: Bucket, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    """(uri, endpoint) of a store that cannot be used: nothing listens there, or it refuses our secret."""
    if request.param == "unreachable":
        return f"s3://kt-{uuid.uuid4().hex[:12]}/store", f"http://127.0.0.1:{free_port()}"
    use_credentials(monkeypatch, {**ADMIN, "AWS_SECRET_ACCESS_KEY": "not-the-secret"})
    return bucket.uri, bucket.endpoint


def test_a_wrong_secret_is_refused_by_the_server(bucket: Bucket, monkeypatch: pytest.MonkeyPatch) -> None:
    from kubetrain.checkpoint.store import check_reachable, describe, open_store

    bucket.fs.pipe_file(bucket.path("x"), b"x")
    assert check_reachable(open_store(bucket.uri, bucket.endpoint)) == "1 entry under it"
    use_credentials(monkeypatch, {**ADMIN, "AWS_SECRET_ACCESS_KEY": "not-the-secret"})
    with pytest.raises(PermissionError) as refused:
        check_reachable(open_store(bucket.uri, bucket.endpoint))
    assert "signature" in describe(refused.value).lower()


def test_a_store_down_is_one_warning_and_a_list_of_what_is_not_uploaded(bad_store: tuple[str, str],
                                                                       tmp_path: Path) -> None:
    uri, endpoint = bad_store
    root = tmp_path / "checkpoints"
    lines: list[str] = []
    cfg = _cfg(uri, endpoint, restore_attempts=2, restore_backoff_seconds=0.01)
    # with no local checkpoint, a store that cannot be read stops the run instead of rewinding it
    with pytest.raises(CheckpointError, match=f"cannot read checkpoints from {uri}/r/checkpoints \\(2 attempts\\)"):
        restore.restore_newest(cfg, None, root, lines.append)
    assert len(lines) == 1 and "(attempt 1 of 2)" in lines[0] and "trying again in 0.01 s" in lines[0]
    lines.clear()
    uploader = remote.Uploader.from_config(cfg, None, root, lines.append)
    assert uploader is not None
    for step in (1, 2):
        uploader.submit(_save(root, step))
    uploader.close()
    warnings = [line for line in lines if line.startswith("warning:")]
    assert len(warnings) == 1, lines
    assert f"{uri}/r/checkpoints" in warnings[0]
    assert lines[-1] == (f"checkpoints not uploaded to {uri}/r/checkpoints: step-000001, step-000002 "
                         f"(they are in {root})")
    assert checkpoint.find_resumable(root) is not None  # the local checkpoints are untouched


def test_close_after_a_stop_names_the_newest_checkpoint_in_the_store(
    bucket: Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "checkpoints"
    cfg = _cfg(bucket.uri, bucket.endpoint)
    first = remote.Uploader.from_config(cfg, None, root, lambda m: None)
    assert first is not None
    first.submit(_save(root, 1))
    first.close()
    monkeypatch.setenv(remote.FAULT_SLOW_UPLOAD, "600")  # the next upload stalls before its meta.json
    lines: list[str] = []
    second = remote.Uploader.from_config(cfg, None, root, lines.append)
    assert second is not None
    second.submit(_save(root, 2))
    second.close(timeout=5)
    assert lines == [
        f"the upload of step-000002 did not finish in time; the newest checkpoint in {bucket.uri}/r/checkpoints "
        "is step-000001",
        f"checkpoints not uploaded to {bucket.uri}/r/checkpoints: step-000002 (they are in {root})",
    ]
    assert bucket.fs.cat_file(bucket.path("r/checkpoints/latest")) == b"step-000001\n"


def test_a_phase_has_its_own_folder_in_the_store(bucket: Bucket) -> None:
    store = remote.checkpoint_store(_cfg(bucket.uri, bucket.endpoint), "code")
    assert store is not None and store.uri == f"{bucket.uri}/r/phases/code/checkpoints"
    assert remote.checkpoint_store(Config()) is None


@pytest.fixture
def no_delete_store(own_bucket: Bucket) -> tuple[str, str]:
    """(uri, endpoint) of a bucket whose credentials may upload checkpoints but not read the `best` pointer, which
    only the retention pass reads: a bucket policy that the server enforces as AWS does. (A denied DeleteObject
    would not do: s3fs's bulk delete ignores the per-key errors S3 returns.)"""
    own_bucket.fs.call_s3("put_bucket_policy", Bucket=own_bucket.name, Policy=json.dumps({
        "Version": "2012-10-17", "Statement": [{"Effect": "Deny", "Principal": "*", "Action": "s3:GetObject",
                                                "Resource": f"arn:aws:s3:::{own_bucket.name}/*/best"}]}))
    return own_bucket.uri, own_bucket.endpoint


def test_a_failed_retention_pass_does_not_mark_a_complete_upload_as_missing(
    no_delete_store: tuple[str, str], tmp_path: Path
) -> None:
    uri, endpoint = no_delete_store
    root = tmp_path / "checkpoints"
    lines: list[str] = []
    uploader = remote.Uploader.from_config(_cfg(uri, endpoint, keep_last=1), None, root, lines.append)
    assert uploader is not None
    for step in (1, 2):  # each upload is complete, then its retention pass cannot read `best`
        uploader.submit(_save(root, step))
    uploader.close()
    store = remote.checkpoint_store(_cfg(uri, endpoint))
    assert store is not None and store.read_text("latest") == "step-000002\n"
    assert store.read_text("step-000002/meta.json") is not None
    assert not any("not uploaded" in line for line in lines), lines
    assert lines[-1] == f"checkpoints uploaded to {uri}/r/checkpoints (latest: step-000002)"
    refused = [line for line in lines if line.startswith("warning:")]
    assert len(refused) == 1 and refused[0].startswith(f"warning: cannot remove old checkpoints from {uri}/r/"), lines


@pytest.fixture
def dropping_endpoint() -> Iterator[str]:
    """An endpoint that accepts each connection and closes it at once: a proxy whose backend is down."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    done.set()
    thread.join()
    server.close()


def test_an_endpoint_that_drops_connections_is_one_warning_not_a_flood_of_tracebacks(
    dropping_endpoint: str, tmp_path: Path, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch
) -> None:
    import s3fs

    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)  # fail in seconds: each retry only repeats the drop
    use_credentials(monkeypatch, ADMIN)  # without credentials botocore gives up before it connects
    root = tmp_path / "checkpoints"
    lines: list[str] = []
    uri = f"s3://kt-{uuid.uuid4().hex[:12]}/store"
    uploader = remote.Uploader.from_config(_cfg(uri, dropping_endpoint), None, root, lines.append)
    assert uploader is not None
    for step in (1, 2):  # small files: each request's body is written before the close is seen, as in the field
        uploader.submit(checkpoint.save(root, step, {"w": torch.zeros(4)}, {"step": step}, {}, keep_last=5))
    uploader.close()
    gc.collect()  # asyncio reports an unretrieved task's exception when the task is collected
    assert [line.split(":")[0] for line in lines] == ["warning", "checkpoints not uploaded to s3"], lines
    err = capfd.readouterr().err  # asyncio logs there; under pytest, its records also land in caplog
    logged = [r.getMessage() for r in caplog.records if r.name == "asyncio"]
    assert "Task exception was never retrieved" not in err and "Traceback" not in err, err[-3000:]
    assert not logged, f"{len(logged)} asyncio errors, the first: {logged[:1]}"

"""Restoring from the store (checkpoint/restore.py): names from the store stay in the folder, the download pool is
bounded, a store that denies reads is one line, and processes that share a folder download once."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from kubetrain import checkpoint
from kubetrain.checkpoint import remote, restore, verdict
from kubetrain.config.schema import Config
from kubetrain.errors import CheckpointError, NoCheckpointVerifies
from tests.object_store import WRITER, Bucket, use_credentials

HOSTILE = ["../../../../pwned.txt", "/tmp/kt-pwned-absolute", "", ".", "optimizer/../../../pwned.txt", "a//b",
           "..\\pwned.txt"]


def _cfg(uri: str, endpoint: str | None = None, **section: object) -> Config:
    return Config.model_validate({"run": {"name": "r"},
                                  "checkpoint": {"uri": uri, "endpoint_url": endpoint, **section}})


def _save(root: Path, step: int) -> checkpoint.Checkpoint:
    gen = torch.Generator().manual_seed(step)
    return checkpoint.save(root, step, {"w": torch.randn(64, 64, generator=gen)}, {"state": {"step": step}},
                           {"tokens": step}, keep_last=100)


def _files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


def _plant(store_root: Path, step: int, name: str, payload: bytes) -> None:
    """Make checkpoint `step` in a path store name `name` too, with a file where a join of that name reads and
    its matching checksum: what someone who can write to the bucket can do."""
    folder = store_root / "r" / "checkpoints" / checkpoint.step_name(step)
    meta = json.loads((folder / checkpoint.META_FILE).read_text())
    if name and name not in (".",) and "\\" not in name and not name.startswith("/"):
        planted = Path(str(folder) + "/" + name)
        planted.parent.mkdir(parents=True, exist_ok=True)
        planted.write_bytes(payload)
    meta["files"][name] = {checkpoint.CHECKSUM: _digest(payload), "bytes": len(payload)}
    (folder / checkpoint.META_FILE).write_text(json.dumps(meta))


def _digest(data: bytes) -> str:
    import xxhash

    return str(xxhash.xxh3_128(data).hexdigest())


def test_a_checkpoint_that_names_a_file_outside_is_skipped_never_written_never_latest(tmp_path: Path) -> None:
    store_root = tmp_path / "store"
    cfg = _cfg(str(store_root))
    store = remote.checkpoint_store(cfg)
    assert store is not None
    source = tmp_path / "source"
    for step in range(1, len(HOSTILE) + 2):  # step 1 is sound; each later one names one hostile file
        remote.upload(store, _save(source, step).path, checkpoint.step_name(step), is_best=step == 2, keep_last=50)
    for step, name in enumerate(HOSTILE, start=2):
        _plant(store_root, step, name, b"pwned\n")
    before = _files(tmp_path)
    run = tmp_path / "work" / "runs" / "r"
    lines: list[str] = []
    restored = restore.restore_newest(cfg, None, run / "checkpoints", lines.append)

    assert restored is not None and restored.step == 1
    assert lines[-1] == f"restored step-000001 from {store_root}/r/checkpoints"
    skipped = lines[:-1]
    assert len(skipped) == len(HOSTILE)
    for line in skipped:
        assert line.startswith(f"warning: skipping {store_root}/r/checkpoints/step-0000"), line
        assert "meta.json names" in line and "not a file inside the checkpoint" in line, line
    assert "\n" not in "".join(lines)
    assert _files(tmp_path) - before == {f"work/runs/r/checkpoints/{f}" for f in _files(run / "checkpoints")}
    assert not Path("/tmp/kt-pwned-absolute").exists()
    assert checkpoint.pointer(run / "checkpoints", checkpoint.LATEST) == "step-000001"
    assert checkpoint.pointer(run / "checkpoints", checkpoint.BEST) is None  # `best` (step 2) was refused
    assert [p.name for p in checkpoint.complete_checkpoints(run / "checkpoints")] == ["step-000001"]


def test_a_local_checkpoint_naming_a_file_outside_does_not_verify(tmp_path: Path) -> None:
    saved = _save(tmp_path / "c", 3)
    (tmp_path / "secret").write_bytes(b"s")
    meta = json.loads((saved.path / checkpoint.META_FILE).read_text())
    meta["files"]["../../secret"] = {checkpoint.CHECKSUM: _digest(b"s"), "bytes": 1}
    (saved.path / checkpoint.META_FILE).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"step-000003: meta.json names '../../secret', not a file inside"):
        checkpoint.verify(saved.path)
    with pytest.raises(NoCheckpointVerifies):  # nor does the run start from step 0 over it
        checkpoint.find_resumable(tmp_path / "c", warn=lambda m: None)


def _many_files(root: Path, n: int) -> Path:
    """A checkpoint folder whose meta.json lists `n` small files (in a subfolder, as DCP shards are)."""
    folder = root / "step-000001"
    (folder / "optimizer").mkdir(parents=True)
    files = {}
    for i in range(n):
        data = f"shard {i}".encode()
        (folder / "optimizer" / f"__{i}_0.distcp").write_bytes(data)
        files[f"optimizer/__{i}_0.distcp"] = {checkpoint.CHECKSUM: _digest(data), "bytes": len(data)}
    (folder / checkpoint.META_FILE).write_text(json.dumps({"step": 1, "files": files}))
    return folder


def test_download_and_hash_pools_are_bounded_however_many_files_are_listed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = 40
    store_root = tmp_path / "store"
    folder = _many_files(store_root / "r" / "checkpoints", n)
    (store_root / "r" / "checkpoints" / "latest").write_text("step-000001\n")
    fetching, hashing = [set[int](), set[int]()]
    fetch, digest = restore._fetch, verdict.file_digest

    def spy_fetch(*args: object) -> str:
        if threading.current_thread() is not threading.main_thread():  # meta.json comes first, in the caller
            fetching.add(threading.get_ident())
        time.sleep(0.01)  # long enough that a pool of n threads would run them all at once
        return fetch(*args)  # type: ignore[arg-type]

    def spy_digest(path: Path) -> str:
        hashing.add(threading.get_ident())
        time.sleep(0.01)
        return digest(path)

    monkeypatch.setattr(restore, "_fetch", spy_fetch)
    monkeypatch.setattr(verdict, "file_digest", spy_digest)
    root = tmp_path / "run" / "checkpoints"
    restored = restore.restore_newest(_cfg(str(store_root)), None, root, lambda m: None)
    assert restored is not None and _files(restored.path) == _files(folder)
    assert 1 < len(fetching) <= restore.DOWNLOAD_THREADS
    (root / ".verified").rename(root / ".verified-not")  # the download's verdict: hash again
    checkpoint.verify(restored.path, deep=True)
    assert 1 < len(hashing) <= verdict.HASH_THREADS


def test_a_store_that_denies_reads_is_one_line_and_writes_nothing(bucket: Bucket, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _cfg(bucket.uri, bucket.endpoint, restore_attempts=2, restore_backoff_seconds=0.01)
    store = remote.checkpoint_store(cfg)
    assert store is not None
    remote.upload(store, _save(tmp_path / "source", 3).path, "step-000003", is_best=False)
    use_credentials(monkeypatch, WRITER)  # may write and list, not read
    root = tmp_path / "run" / "checkpoints"
    with pytest.raises(CheckpointError) as refused:
        restore.restore_once(cfg, None, root, lambda m: None)
    message = str(refused.value)
    assert message.startswith(f"cannot read checkpoints from {bucket.uri}/r/checkpoints (2 attempts): ")
    assert "Forbidden (access denied to these credentials)" in message and "\n" not in message
    assert _files(root) == set() or all(f.startswith(restore.RESTORE_DIR) for f in _files(root)), _files(root)
    assert checkpoint.pointer(root, checkpoint.LATEST) is None


WORKER = """
import sys, time
from pathlib import Path
from kubetrain.checkpoint import restore
from kubetrain.config.schema import Config
uri, endpoint, root, go = sys.argv[1:5]
cfg = Config.model_validate({"run": {"name": "r"}, "checkpoint": {"uri": uri, "endpoint_url": endpoint}})
while not Path(go).exists():  # every process is up and imported before any restores: they race for real
    time.sleep(0.01)
restore.restore_once(cfg, None, Path(root), print)
"""


def _race(bucket: Bucket, roots: list[Path], go: Path) -> list[subprocess.CompletedProcess[str]]:
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, bucket.uri, bucket.endpoint, str(root), str(go)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for root in roots]
    time.sleep(0.5)
    go.touch()
    done = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


@pytest.mark.slow
def test_processes_that_share_a_folder_read_the_store_once(own_bucket: Bucket, tmp_path: Path) -> None:
    """Three processes on one folder (ranks, or nodes that share a claim) and one on a folder of its own (a node
    with node-local storage): two restores, counted in bytes by the server."""
    cfg = _cfg(own_bucket.uri, own_bucket.endpoint)
    store = remote.checkpoint_store(cfg)
    assert store is not None
    remote.upload(store, _save(tmp_path / "source", 3).path, "step-000003", is_best=True)
    server, start = own_bucket.server, own_bucket.server.sent_bytes(own_bucket.name)
    assert restore.restore_newest(cfg, None, tmp_path / "alone" / "checkpoints", lambda m: None) is not None
    one = server.sent_bytes(own_bucket.name) - start  # what one restore reads: the files and two pointers
    assert one > 64 * 64 * 4

    shared, local = tmp_path / "shared" / "checkpoints", tmp_path / "local" / "checkpoints"
    results = _race(own_bucket, [shared, shared, shared, local], tmp_path / "go")
    assert all(r.returncode == 0 for r in results), [r.stderr[-2000:] for r in results]
    assert server.sent_bytes(own_bucket.name) - start - one == 2 * one
    # each that restored or waited for the restore says it, whichever process downloaded; one that came to the
    # folder after the restore had finished (a late start under load) finds a checkpoint there and says nothing
    said = [r.stdout.splitlines() for r in results]
    restored = [f"restored step-000003 from {own_bucket.uri}/r/checkpoints"]
    assert all(lines in (restored, []) for lines in said), said
    assert restored in said[:3] and said[3] == restored, said  # the shared folder's downloader; the lone one
    for folder in (shared, local):
        assert [p.name for p in checkpoint.complete_checkpoints(folder)] == ["step-000003"]
        assert checkpoint.pointer(folder, checkpoint.LATEST) == "step-000003"
        assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]


def test_a_failed_restore_fails_the_processes_waiting_for_it_with_its_message(
    bucket: Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _cfg(bucket.uri, bucket.endpoint, restore_attempts=3, restore_backoff_seconds=0.3)
    store = remote.checkpoint_store(cfg)
    assert store is not None
    remote.upload(store, _save(tmp_path / "source", 3).path, "step-000003", is_best=False)
    use_credentials(monkeypatch, WRITER)  # every read is denied: the restore fails after its 3 attempts
    root = tmp_path / "run" / "checkpoints"
    said: dict[str, list[str]] = {"first": [], "second": []}
    errors: dict[str, str] = {}

    def rank(name: str) -> None:
        try:
            restore.restore_once(cfg, None, root, said[name].append)
        except CheckpointError as e:
            errors[name] = str(e)

    first = threading.Thread(target=rank, args=("first",))
    first.start()
    while not (root / restore.RESTORE_DIR / "restore").exists() and first.is_alive():
        time.sleep(0.01)  # the first holds the claim: the second waits for it
    rank("second")
    first.join()
    assert errors["first"] == errors["second"] and "(3 attempts)" in errors["first"]
    assert sum("attempt" in line for line in said["first"]) == 2  # the tries are the first's alone
    assert not any("attempt" in line for line in said["second"]), said["second"]


def test_an_upload_never_sends_a_file_from_outside_the_checkpoint(tmp_path: Path) -> None:
    saved = _save(tmp_path / "run" / "checkpoints", 3)
    (tmp_path / "secret").write_bytes(b"s")
    meta = json.loads((saved.path / checkpoint.META_FILE).read_text())
    meta["files"]["../../../secret"] = {checkpoint.CHECKSUM: _digest(b"s"), "bytes": 1}
    (saved.path / checkpoint.META_FILE).write_text(json.dumps(meta))
    store = remote.checkpoint_store(_cfg(str(tmp_path / "store")))
    assert store is not None
    with pytest.raises(CheckpointError, match=r"meta\.json names '\.\./\.\./\.\./secret', not a file inside"):
        remote.upload(store, saved.path, saved.path.name, is_best=False)
    assert b"s" not in [p.read_bytes() for p in (tmp_path / "store").rglob("*") if p.is_file()]

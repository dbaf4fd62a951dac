"""`kubetrain train` with `checkpoint.uri` on a real S3-compatible server: a run whose local folder is lost
resumes from the bucket, bitwise equal to a run never interrupted (CPU); a store that is down never stops a run
that has its checkpoints, and stops one that would otherwise start again from step 0; a checkpoint in the store that
names a file outside its folder is never restored."""

from __future__ import annotations

import json
import shutil
import signal
import uuid
from pathlib import Path

import pytest

from kubetrain.checkpoint.remote import FAULT_SLOW_UPLOAD
from kubetrain.errors import EXIT_STOPPED_RESUMABLE
from tests.conftest import assert_same_weights
from tests.object_store import ADMIN, WRITER, Bucket, free_port, use_credentials
from tests.train.conftest import _no_leftover_processes, kubetrain, lines_in, sets, start, wait_until

pytestmark = pytest.mark.slow
__all__ = ["_no_leftover_processes"]  # the autouse fixture that kills what a test started

STEPS = 24


def _args(name: str, cache: Path, *extra: str) -> list[str]:
    return ["train", *sets(
        f"run.name={name}", f"train.max_steps={STEPS}", "checkpoint.every_steps=3", "checkpoint.keep_last=2",
        "eval.every_steps=6", "train.log_every_steps=1", f"data.cache_dir={cache}", *extra,
    )]


def _on(bucket: Bucket) -> list[str]:
    return [f"checkpoint.uri={bucket.uri}", f"checkpoint.endpoint_url={bucket.endpoint}"]


def _train_losses(run: Path, after: int = 0) -> list[tuple[int, float]]:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in recs if r["kind"] == "train" and r["step"] > after]


def _assert_same_end(run: Path, reference: Path, resumed_at: int) -> None:
    assert _train_losses(run, resumed_at) == _train_losses(reference, resumed_at)
    final = f"checkpoints/step-{STEPS:06d}/model.safetensors"
    assert_same_weights(run / final, reference / final)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    cwd = tmp_path_factory.mktemp("ref")
    cache = cwd / "cache"
    kubetrain(*_args("ref", cache), cwd=cwd)
    return cwd / "runs" / "ref", cache


def _pointer(bucket: Bucket, rel: str) -> str | None:
    try:
        return bucket.fs.cat_file(bucket.path(rel)).decode().strip()
    except FileNotFoundError:
        return None


def _complete_in_bucket(bucket: Bucket, folder: str) -> bool:
    """The checkpoint folder in the bucket holds meta.json and every file it lists, at its size."""
    try:
        meta = json.loads(bucket.fs.cat_file(bucket.path(f"{folder}/meta.json")))
    except FileNotFoundError:
        return False
    sizes = {p.rsplit("/", 1)[1]: info["size"] for p, info in bucket.fs.find(bucket.path(folder), detail=True).items()}
    return all(sizes.get(f) == info["bytes"] for f, info in meta["files"].items())


@pytest.mark.ci  # a heavy end-to-end proof (many processes): .ci/run runs it, not the README's test command
def test_sigterm_uploads_and_an_empty_folder_resumes_from_the_bucket_bitwise(
    reference: tuple[Path, Path], bucket: Bucket, tmp_path: Path
) -> None:
    ref, cache = reference
    run = tmp_path / "runs" / "s3"
    args = _args("s3", cache, *_on(bucket))
    proc = start(*args, cwd=tmp_path)
    wait_until(lambda: lines_in(run / "metrics.jsonl") >= 8, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_STOPPED_RESUMABLE, err
    stopped = int(json.loads((run / "meta.json").read_text())["step"])
    assert f"checkpoints uploaded to {bucket.uri}/s3/checkpoints (latest: step-{stopped:06d})" in out
    assert _pointer(bucket, "s3/checkpoints/latest") == f"step-{stopped:06d}"

    shutil.rmtree(run)  # the pod lands on a node without the claim
    resumed = kubetrain(*args, cwd=tmp_path)
    assert f"restored step-{stopped:06d} from {bucket.uri}/s3/checkpoints" in resumed.stdout
    assert f"resuming from runs/s3/checkpoints/step-{stopped:06d}" in resumed.stdout
    _assert_same_end(run, ref, stopped)
    assert _pointer(bucket, "s3/checkpoints/latest") == f"step-{STEPS:06d}"


@pytest.mark.ci  # a heavy end-to-end proof (many processes): .ci/run runs it, not the README's test command
def test_sigkill_during_an_upload_never_leaves_latest_on_a_partial_checkpoint(
    reference: tuple[Path, Path], bucket: Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref, cache = reference
    run = tmp_path / "runs" / "killed"
    args = _args("killed", cache, *_on(bucket))
    prefix = "killed/checkpoints"

    def mid_upload() -> bool:
        """`latest` is in the bucket, and a newer checkpoint has files there but no meta.json yet."""
        latest = _pointer(bucket, f"{prefix}/latest")
        if latest is None:
            return False
        folders = [p.rsplit("/", 1)[1] for p in bucket.fs.ls(bucket.path(prefix))]
        return any(f.startswith("step-") and f > latest and not _complete_in_bucket(bucket, f"{prefix}/{f}")
                   and bucket.fs.ls(bucket.path(f"{prefix}/{f}")) for f in folders)

    monkeypatch.setenv(FAULT_SLOW_UPLOAD, "2")  # each upload waits 2 s between its files and its meta.json
    proc = start(*args, cwd=tmp_path)
    wait_until(mid_upload, proc, poll=0.05)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    latest = _pointer(bucket, f"{prefix}/latest")
    assert latest is not None and _complete_in_bucket(bucket, f"{prefix}/{latest}")

    monkeypatch.delenv(FAULT_SLOW_UPLOAD)
    shutil.rmtree(run)
    resumed = kubetrain(*args, cwd=tmp_path)
    assert f"restored {latest} from" in resumed.stdout  # not the newer folder whose upload was cut off
    _assert_same_end(run, ref, int(latest.removeprefix("step-")))


# the store unreachable here; a wrong secret and denied reads (the same path, other answers): CI's stage
@pytest.mark.parametrize("trouble", ["unreachable", pytest.param("wrong-secret", marks=pytest.mark.ci),
                                     pytest.param("reads-denied", marks=pytest.mark.ci)])
def test_a_store_that_is_down_stops_a_run_with_no_checkpoint_and_resume_never_starts_afresh(
    trouble: str, reference: tuple[Path, Path], bucket: Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, cache = reference
    uri, endpoint = bucket.uri, bucket.endpoint
    if trouble == "unreachable":
        uri, endpoint = f"s3://kt-{uuid.uuid4().hex[:12]}/store", f"http://127.0.0.1:{free_port()}"
    elif trouble == "reads-denied":  # a checkpoint is there; these credentials may list and write, not read
        bucket.fs.pipe_file(bucket.path("down/checkpoints/step-000003/meta.json"), b"{}")
        use_credentials(monkeypatch, WRITER)
    else:
        use_credentials(monkeypatch, {**ADMIN, "AWS_SECRET_ACCESS_KEY": "not-the-secret"})
    args = _args("down", cache, "train.max_steps=6", f"checkpoint.uri={uri}", f"checkpoint.endpoint_url={endpoint}",
                 "checkpoint.restore_attempts=2", "checkpoint.restore_backoff_seconds=0.1")
    refused = kubetrain(*args, cwd=tmp_path, check=False)  # --resume auto: the store is the only record
    assert not list((tmp_path / "runs" / "down" / "checkpoints").glob("step-*"))  # nothing restored
    if trouble == "reads-denied":
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", ADMIN["AWS_ACCESS_KEY_ID"])  # uploads need no reads, but
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")  # the counts below are the store-down ones
    done = kubetrain(*args, "--resume", "never", cwd=tmp_path)  # starting afresh on purpose
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert refused.stderr.splitlines()[-1].startswith(
        f"error: cannot read checkpoints from {uri}/down/checkpoints (2 attempts): ")
    assert "Traceback" not in refused.stderr and "start afresh on purpose with --resume never" in refused.stderr
    lines = (done.stdout + done.stderr).splitlines()
    assert len([line for line in lines if "warning" in line.lower()]) == 1, done.stdout + done.stderr
    assert (f"checkpoints not uploaded to {uri}/down/checkpoints: step-000003, step-000006 "
            f"(they are in runs/down/checkpoints)") in lines
    assert "Traceback" not in done.stderr
    assert (tmp_path / "runs" / "down" / "checkpoints" / "step-000006" / "meta.json").is_file()


def test_a_checkpoint_in_the_store_that_names_a_file_outside_is_never_restored(
    reference: tuple[Path, Path], tmp_path: Path
) -> None:
    """An attack: a path store whose newest checkpoint's meta.json lists ../../../../<name> (with that file and
    its checksum), restored by --resume auto into an empty run folder, must not write <name> outside the run."""
    import xxhash

    _, cache = reference
    store = tmp_path / "store"
    args = _args("victim", cache, "train.max_steps=6", f"checkpoint.uri={store}")
    trained = tmp_path / "first"
    trained.mkdir()
    kubetrain(*args, cwd=trained)  # uploads step 3 and step 6 to the store
    newest = store / "victim" / "checkpoints" / "step-000006"
    assert (newest / "meta.json").is_file() and (store / "victim" / "checkpoints" / "step-000003").is_dir()
    payload = b"written by whoever can write to the bucket\n"
    meta = json.loads((newest / "meta.json").read_text())
    meta["files"]["../../../../pwned.txt"] = {"xxh3_128": xxhash.xxh3_128(payload).hexdigest(), "bytes": len(payload)}
    (newest / "meta.json").write_text(json.dumps(meta))
    (newest / "../../../../pwned.txt").write_bytes(payload)  # where the store reads that name: beside the store

    node = tmp_path / "node"  # a new node: an empty run folder, the same config
    node.mkdir()
    resumed = kubetrain(*args, cwd=node, check=False)
    assert not (node / "pwned.txt").exists(), "the checkpoint wrote outside the run directory"
    assert resumed.returncode == 0, resumed.stderr
    assert (f"warning: skipping {store}/victim/checkpoints/step-000006: meta.json names '../../../../pwned.txt', "
            f"not a file inside the checkpoint (it climbs out with ..)") in resumed.stdout
    assert f"restored step-000003 from {store}/victim/checkpoints" in resumed.stdout
    assert "resuming from runs/victim/checkpoints/step-000003" in resumed.stdout
    assert sorted(str(p.relative_to(node)) for p in node.iterdir()) == ["runs"]


@pytest.mark.ci  # two trainings (21 s); test_restore counts the same bytes with processes (CI's stage)
def test_two_ranks_on_an_empty_folder_read_the_store_once(reference: tuple[Path, Path], own_bucket: Bucket,
                                                         tmp_path: Path) -> None:
    """`--nproc 2` resuming from the bucket: one rank downloads, the other waits on the folder (no barrier)."""
    _, cache = reference
    args = _args("pair", cache, "train.max_steps=6", *_on(own_bucket))
    kubetrain(*args, cwd=tmp_path)
    shutil.rmtree(tmp_path / "runs" / "pair")
    folder = own_bucket.path("pair/checkpoints/step-000006")
    size = sum(info["size"] for info in own_bucket.fs.find(folder, detail=True).values())
    before = own_bucket.server.sent_bytes(own_bucket.name)
    resumed = kubetrain(*args, "--set", "train.max_steps=9", "--nproc", "2", cwd=tmp_path)
    read = own_bucket.server.sent_bytes(own_bucket.name) - before
    assert resumed.stdout.count(f"restored step-000006 from {own_bucket.uri}/pair/checkpoints") == 1, resumed.stdout
    assert "resuming from runs/pair/checkpoints/step-000006" in resumed.stdout
    # the files once (two ranks each downloading would be twice); beside them the pointers, and the uploader of the
    # resumed run reading the newest checkpoint's meta.json to know it is in the store already
    assert size <= read < 1.5 * size, (read, size)

"""Checkpoints in object storage: uploaded in the background, restored when the local folder has none.

`checkpoint.uri` is to the store what `run.output_dir` is to the disk: a run's checkpoints go to
<uri>/<run.name>/checkpoints/ (a phase's to <uri>/<run.name>/phases/<phase>/checkpoints/), the same layout
as the run directory, so `kubetrain runs sync URI/<run.name> DIR` pulls them with the rest of the run.

  step-000200/  the checkpoint's files, then its meta.json last: a folder without meta.json is an upload
                that did not finish, and is never restored
  latest, best  written only after every file of the checkpoint they name is there

Every checkpoint is first written locally as before (atomic, checksummed); the store is a copy. A store
that cannot be reached while training costs one warning line, never the run; but with an empty local folder the
store is the run's only record, and a store that cannot be read stops the run (exit 1) instead of rewinding it.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kubetrain import checkpoint
from kubetrain.checkpoint import BEST, LATEST, META_FILE, Checkpoint, verdict
from kubetrain.checkpoint.store import Store, check_reachable, describe, open_store
from kubetrain.config.schema import Config
from kubetrain.errors import CheckpointError
from kubetrain.files import write_atomic

Log = Callable[[str], None]

# Fault injection for tests: seconds to wait between a checkpoint's data files and its meta.json, so that a
# test can kill the process while an upload is half done.
FAULT_SLOW_UPLOAD = "KUBETRAIN_FAULT_SLOW_UPLOAD"
STAGING = ".upload"  # under checkpoints/: hard links of the checkpoints waiting for upload
_STEP = re.compile(r"^step-(\d{6,})$")
_warned: set[str] = set()  # stores already warned about in this process: one warning line each
_warned_lock = threading.Lock()


def warn_once(store: Store, log: Log, what: str, e: BaseException) -> None:
    """One warning line per store and process, however many of its operations fail."""
    with _warned_lock:
        if store.uri in _warned:
            return
        _warned.add(store.uri)
    log(f"warning: {what} {store.uri}: {describe(e)}; training goes on with the local checkpoints")


def checkpoint_store(cfg: Config, phase: str | None = None) -> Store | None:
    """Where this run's (or phase's) checkpoints go in the store; None without `checkpoint.uri`."""
    if not cfg.checkpoint.uri:
        return None
    rel = f"{cfg.run.name}/phases/{phase}/checkpoints" if phase else f"{cfg.run.name}/checkpoints"
    return open_store(cfg.checkpoint.uri, cfg.checkpoint.endpoint_url).child(rel)


def _step(name: str) -> int:
    m = _STEP.match(name)
    return int(m.group(1)) if m else -1


def _pointer(store: Store, which: str) -> str | None:
    text = store.read_text(which)
    return (text or "").strip() or None


def upload(store: Store, local: Path, name: str, *, is_best: bool, keep_last: int | None = None) -> None:
    """Upload the checkpoint folder `local` as `name`: its files, then meta.json, then the pointers; prune.

    The Uploader prunes on its own (keep_last None): a failed retention pass leaves this checkpoint complete.
    """
    meta = json.loads((local / META_FILE).read_text())
    expected = {f: int(info["bytes"]) for f, info in meta["files"].items()}
    store.put([(local / f, f"{name}/{f}") for f in sorted(expected)])
    delay = float(os.environ.get(FAULT_SLOW_UPLOAD) or 0)
    if delay:
        time.sleep(delay)
    store.put([(local / META_FILE, f"{name}/{META_FILE}")])
    there = store.child(name).sizes()
    short = [f for f, n in expected.items() if there.get(f) != n]
    if short or META_FILE not in there:
        raise CheckpointError(f"{name}: {(short or [META_FILE])[0]} did not arrive whole")
    store.write_text(LATEST, name + "\n")
    if is_best:
        store.write_text(BEST, name + "\n")
    if keep_last is not None:
        prune(store, keep_last, current=_step(name))


def prune(store: Store, keep_last: int, current: int) -> None:
    """Keep the newest `keep_last` complete checkpoints and the ones `latest` and `best` name.

    Unfinished uploads older than `current` are removed; anything newer than `current` is left alone.
    """
    listing = store.sizes()
    names = sorted({rel.split("/")[0] for rel in listing if _STEP.match(rel.split("/")[0])}, key=_step)
    complete = [n for n in names if f"{n}/{META_FILE}" in listing]
    keep = {_pointer(store, LATEST), _pointer(store, BEST), *complete[-keep_last:]}
    for name in names:
        if name not in keep and _step(name) <= current:
            store.remove(name)


def restore_newest(cfg: Config, phase: str | None, ckpt_root: Path, log: Log) -> Checkpoint | None:
    """With `checkpoint.uri` and no local checkpoint: download the newest checkpoint in the store that verifies.

    It is downloaded into a temporary folder, verified against its checksums and renamed into place, so
    `--resume auto` then continues from it exactly as from a local checkpoint. The one the store's `latest`
    names is tried first: a run restarted from scratch under the same name may have left newer steps of
    its earlier life there. Then the others, newest first.

    A store that cannot be read never rewinds the run to step 0: it is tried `checkpoint.restore_attempts`
    times with a doubling wait, then this raises CheckpointError (exit 1) naming the store and the error.
    So does a store whose complete checkpoints all fail to verify. An empty store starts the run afresh.
    """
    if not cfg.checkpoint.uri or checkpoint.complete_checkpoints(ckpt_root):
        return None
    store = checkpoint_store(cfg, phase)
    assert store is not None
    attempts, wait = cfg.checkpoint.restore_attempts, cfg.checkpoint.restore_backoff_seconds
    for attempt in range(1, attempts + 1):
        try:
            return _restore_from(store, ckpt_root, log)
        except CheckpointError:
            raise
        except Exception as e:  # network, credentials, a missing bucket: the store cannot be read (yet)
            if attempt == attempts:
                raise CheckpointError(
                    f"cannot read checkpoints from {store.uri} ({attempts} attempts): {describe(e)}; the local "
                    f"folder has none, so the run would start again from step 0: fix the store, or start afresh on "
                    f"purpose with --resume never"
                ) from None
            log(f"warning: cannot read checkpoints from {store.uri} (attempt {attempt} of {attempts}): "
                f"{describe(e)}; trying again in {wait:g} s")
            time.sleep(wait)
            wait *= 2
    return None


def _restore_from(store: Store, ckpt_root: Path, log: Log) -> Checkpoint | None:
    """One attempt of `restore_newest`: what the store raises, it raises."""
    listing = store.sizes()
    if not listing:
        check_reachable(store)  # an empty folder in a bucket that exists, not a missing bucket
    names = sorted({rel.split("/")[0] for rel in listing if _STEP.match(rel.split("/")[0])}, key=_step)
    latest = _pointer(store, LATEST)
    complete = 0
    for name in sorted(names, key=lambda n: (n == latest, _step(n)), reverse=True):
        complete += f"{name}/{META_FILE}" in listing
        try:
            restored = download(store, name, listing, ckpt_root)
        except CheckpointError as e:
            log(f"warning: skipping {store.uri}/{name}: {e}")
            continue
        log(f"restored {name} from {store.uri}")
        return restored
    if complete:
        raise CheckpointError(
            f"none of the {complete} checkpoints in {store.uri} verifies and the local folder has none: the run "
            f"would start again from step 0; repair the store, or start afresh on purpose with --resume never"
        )
    return None


def download(store: Store, name: str, listing: dict[str, int], ckpt_root: Path) -> Checkpoint:
    """Download checkpoint `name` into `ckpt_root`, verified, and point `latest` (and `best`) at it."""
    if f"{name}/{META_FILE}" not in listing:
        raise CheckpointError("its upload did not finish (no meta.json)")
    # A name of its own per process: two nodes that share the folder may both download.
    tmp = ckpt_root / f"{name}.download-{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _fetch(store, f"{name}/{META_FILE}", tmp / META_FILE)
        try:
            files = json.loads((tmp / META_FILE).read_text())["files"]
            digests = {f: str(info[checkpoint.CHECKSUM]) for f, info in files.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"unreadable meta.json ({e})") from None
        # Each file is hashed and flushed to disk as soon as it is in, while the others still download.
        with ThreadPoolExecutor(max_workers=max(1, len(files))) as pool:
            got = dict(zip(files, pool.map(lambda f: _fetch(store, f"{name}/{f}", tmp / f), files), strict=True))
        for f in sorted(files):
            if got[f] != digests[f]:
                raise CheckpointError(f"{f} fails its checksum")
        try:
            checkpoint.verify(tmp, deep=False)  # sizes and the layout; the checksums were compared above
        except CheckpointError as e:
            raise CheckpointError(str(e).removeprefix(f"{tmp.name}: ")) from None
        try:
            os.rename(tmp, ckpt_root / name)
        except OSError:  # another process put the same checkpoint there first
            pass
        else:  # hashed above as it arrived: the ranks that resume from it need not read it again
            verdict.record(ckpt_root / name, files, None, written_here=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    write_atomic(ckpt_root / LATEST, name + "\n")
    if _pointer(store, BEST) == name:
        write_atomic(ckpt_root / BEST, name + "\n")
    return checkpoint.verify(ckpt_root / name, deep=False)


def _fetch(store: Store, rel: str, local: Path) -> str:
    """Download one file, then return its xxh3-128 digest once it is on disk (fsynced)."""
    try:
        store.get([(rel, local)])
    except FileNotFoundError:
        raise CheckpointError(f"{rel.split('/', 1)[-1]} is missing") from None
    digest = checkpoint.file_digest(local)
    with open(local, "rb") as fh:
        os.fsync(fh.fileno())
    return digest


@dataclass(frozen=True)
class _Job:
    name: str
    stage: Path
    is_best: bool
    if_missing: bool = False  # skip it when the store's `latest` already names a complete copy


class Uploader:
    """Uploads checkpoints in a background thread, so that training steps never wait for the network.

    A submitted checkpoint's files are hard-linked into checkpoints/.upload/ first (no copy): pruning the
    local checkpoints cannot take them away in the middle of their upload.
    """

    def __init__(self, store: Store, ckpt_root: Path, keep_last: int, log: Log) -> None:
        self.store, self.ckpt_root, self.keep_last, self.log = store, ckpt_root, keep_last, log
        self.staging = ckpt_root / STAGING
        shutil.rmtree(self.staging, ignore_errors=True)  # what a killed run left there
        self.uploaded: list[str] = []
        self.failed: list[str] = []
        self.pending: list[str] = []
        self.newest: str | None = None  # the newest checkpoint of this run known to be in the store
        self._prune_warned = False
        self._count = 0
        self._lock = threading.Lock()
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="checkpoint-upload", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, cfg: Config, phase: str | None, ckpt_root: Path, log: Log) -> Uploader | None:
        """An uploader for `checkpoint.uri` (None without one); it first uploads the local `latest` if missing."""
        store = checkpoint_store(cfg, phase)
        if store is None:
            return None
        uploader = cls(store, ckpt_root, cfg.checkpoint.keep_last, log)
        latest = checkpoint.pointer(ckpt_root, LATEST)
        if latest and (ckpt_root / latest / META_FILE).is_file():
            is_best = checkpoint.pointer(ckpt_root, BEST) == latest
            uploader._enqueue(latest, ckpt_root / latest, is_best, if_missing=True)
        return uploader

    def submit(self, saved: Checkpoint, is_best: bool = False) -> None:
        """Queue a checkpoint that was just saved locally; returns at once."""
        self._enqueue(saved.path.name, saved.path, is_best)

    def _enqueue(self, name: str, path: Path, is_best: bool, if_missing: bool = False) -> None:
        self._count += 1
        stage = self.staging / f"{name}.{self._count}"
        try:
            _link_tree(path, stage)
        except OSError as e:
            self._failed(name, e)
            return
        with self._lock:
            self.pending.append(name)
        self._queue.put(_Job(name, stage, is_best, if_missing))

    def _run(self) -> None:
        try:
            self.newest = _pointer(self.store, LATEST)  # also tells early when the store cannot be reached
        except Exception as e:  # training never fails because the store does
            self._failed(None, e)
        while (job := self._queue.get()) is not None:
            try:
                if not (job.if_missing and self._in_store(job.name)):
                    upload(self.store, job.stage, job.name, is_best=job.is_best)
                    self._prune(job.name)
                with self._lock:
                    self.uploaded.append(job.name)
                    self.newest = job.name
            except Exception as e:  # network, credentials, a full bucket: warn, keep training
                self._failed(job.name, e)
            finally:
                shutil.rmtree(job.stage, ignore_errors=True)
                with self._lock:
                    self.pending.remove(job.name)

    def _prune(self, name: str) -> None:
        """The retention pass after `name` is complete in the store: its failure costs old copies, not `name`."""
        try:
            prune(self.store, self.keep_last, current=_step(name))
        except Exception as e:
            if not self._prune_warned:
                self._prune_warned = True
                self.log(f"warning: cannot remove old checkpoints from {self.store.uri}: {describe(e)}; "
                         f"the uploads go on, older checkpoints stay there")

    def _in_store(self, name: str) -> bool:
        return _pointer(self.store, LATEST) == name and self.store.read_text(f"{name}/{META_FILE}") is not None

    def _failed(self, name: str | None, e: BaseException) -> None:
        if name:
            with self._lock:
                self.failed.append(name)
        warn_once(self.store, self.log, "cannot upload checkpoints to", e)

    def close(self, timeout: float | None = None) -> None:
        """Wait for the queued uploads (at most `timeout` seconds), then say what is not in the store."""
        self._queue.put(None)
        self._thread.join(timeout)
        with self._lock:
            pending, uploaded, newest = list(self.pending), set(self.uploaded), self.newest
            missing = list(dict.fromkeys(n for n in self.failed + pending if n not in uploaded))
        where = self.store.uri
        if pending:
            has = f"the newest checkpoint in {where} is {newest}" if newest else f"{where} has no checkpoint of it"
            self.log(f"the upload of {pending[-1]} did not finish in time; {has}")
        if missing:
            self.log(f"checkpoints not uploaded to {where}: {', '.join(missing)} (they are in {self.ckpt_root})")
        elif uploaded:
            self.log(f"checkpoints uploaded to {where} (latest: {newest})")
        if not self._thread.is_alive():
            shutil.rmtree(self.staging, ignore_errors=True)


def _link_tree(src: Path, dst: Path) -> None:
    """Hard links of every file under `src` in `dst` (copies where the filesystem has no hard links)."""
    for f in src.rglob("*"):
        if f.is_file():
            target = dst / f.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(f, target)
            except OSError:
                shutil.copy2(f, target)

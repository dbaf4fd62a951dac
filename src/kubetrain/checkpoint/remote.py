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
from dataclasses import dataclass
from pathlib import Path

from kubetrain import checkpoint
from kubetrain.checkpoint import BEST, LATEST, META_FILE, Checkpoint
from kubetrain.checkpoint.read import inside_checkpoint
from kubetrain.checkpoint.store import Store, describe, open_store
from kubetrain.config.schema import Config
from kubetrain.errors import CheckpointError

Log = Callable[[str], None]

# Fault injection for tests: seconds to wait between a checkpoint's data files and its meta.json, so that a
# test can kill the process while an upload is half done.
FAULT_SLOW_UPLOAD = "KUBETRAIN_FAULT_SLOW_UPLOAD"
STAGING = ".upload"  # under checkpoints/: hard links of the checkpoints waiting for upload
STEP_DIR = re.compile(r"^step-(\d{6,})$")
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


def step_of(name: str) -> int:
    m = STEP_DIR.match(name)
    return int(m.group(1)) if m else -1


def store_pointer(store: Store, which: str) -> str | None:
    text = store.read_text(which)
    return (text or "").strip() or None


def upload(store: Store, local: Path, name: str, *, is_best: bool, keep_last: int | None = None) -> None:
    """Upload the checkpoint folder `local` as `name`: its files, then meta.json, then the pointers; prune.

    The Uploader prunes on its own (keep_last None): a failed retention pass leaves this checkpoint complete.
    """
    meta = json.loads((local / META_FILE).read_text())
    expected = {f: int(info["bytes"]) for f, info in meta["files"].items()}
    store.put([(inside_checkpoint(local, f), f"{name}/{f}") for f in sorted(expected)])  # never a file elsewhere
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
        prune(store, keep_last, current=step_of(name))


def prune(store: Store, keep_last: int, current: int) -> None:
    """Keep the newest `keep_last` complete checkpoints and the ones `latest` and `best` name.

    Unfinished uploads older than `current` are removed; anything newer than `current` is left alone.
    """
    listing = store.sizes()
    names = sorted({rel.split("/")[0] for rel in listing if STEP_DIR.match(rel.split("/")[0])}, key=step_of)
    complete = [n for n in names if f"{n}/{META_FILE}" in listing]
    keep = {store_pointer(store, LATEST), store_pointer(store, BEST), *complete[-keep_last:]}
    for name in names:
        if name not in keep and step_of(name) <= current:
            store.remove(name)


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
            self.newest = store_pointer(self.store, LATEST)  # also tells early when the store cannot be reached
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
            prune(self.store, self.keep_last, current=step_of(name))
        except Exception as e:
            if not self._prune_warned:
                self._prune_warned = True
                self.log(f"warning: cannot remove old checkpoints from {self.store.uri}: {describe(e)}; "
                         f"the uploads go on, older checkpoints stay there")

    def _in_store(self, name: str) -> bool:
        return store_pointer(self.store, LATEST) == name and self.store.read_text(f"{name}/{META_FILE}") is not None

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

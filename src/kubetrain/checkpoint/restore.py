"""Restoring checkpoints from object storage when the local folder has none: once per folder, verified.

A job restarted on nodes whose checkpoint folder is empty (a new node, a lost claim) restores from
`checkpoint.uri`. Every process of the job calls `restore_once`; the first to claim the restore (a claim file in
checkpoints/.restore/, data/claims.py: O_EXCL, no flock, a heartbeat, taken over when its owner dies) downloads,
the others wait on the folder, outside any collective, as data preparation does. Where the checkpoint folder is
shared by the job's nodes, the checkpoint is read from the store once per job; where it is node-local, once per
node. What the downloader said (which checkpoint, what it skipped) is written beside the claim, so rank 0 says it
whichever process downloaded.

Every name a store gives (its listing, a checkpoint's meta.json) must stay inside the checkpoint folder
(outside_names.join_inside): a checkpoint that names anything else is skipped with a warning, never written,
never `latest`.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kubetrain import checkpoint
from kubetrain.checkpoint import BEST, LATEST, META_FILE, Checkpoint, verdict
from kubetrain.checkpoint.read import inside_checkpoint
from kubetrain.checkpoint.remote import STEP_DIR, Log, checkpoint_store, step_of, store_pointer
from kubetrain.checkpoint.store import Store, check_reachable, describe
from kubetrain.config.schema import Config
from kubetrain.data.claims import Claims, process_tag, share
from kubetrain.errors import CheckpointError, DataError
from kubetrain.files import write_atomic

DOWNLOAD_THREADS = 8  # at most, whatever the number of files a meta.json lists
RESTORE_DIR = ".restore"  # in the checkpoints folder: the claim of the restore and what it said
_TASK = "restore"
_SAID = "said.json"


def restore_once(cfg: Config, phase: str | None, ckpt_root: Path, log: Log) -> None:
    """`restore_newest` by one process of all that share `ckpt_root`; the others wait for it (no collective).

    A restore that fails (CheckpointError) fails every waiting process with the same message.
    """
    if not cfg.checkpoint.uri or checkpoint.complete_checkpoints(ckpt_root):
        return
    claims = Claims(ckpt_root / RESTORE_DIR)
    said = claims.folder / _SAID
    downloaded: list[bool] = []

    def fresh() -> bool:  # written by a restore of this start, not by an earlier life of the job
        try:
            return said.stat().st_mtime >= claims.started
        except FileNotFoundError:
            return False

    def finished() -> set[str]:
        restored = checkpoint.complete_checkpoints(ckpt_root) and not claims.is_claimed(_TASK)
        return {_TASK} if downloaded or fresh() or restored else set()  # (done here: whatever the file times say)

    def restore(_: str) -> None:
        lines: list[str] = []
        downloaded.append(True)

        def say(line: str) -> None:
            lines.append(line)
            log(line)

        try:
            restore_newest(cfg, phase, ckpt_root, say)
        except CheckpointError as e:
            claims.fail(_TASK, str(e))
            raise
        write_atomic(said, json.dumps(lines))

    try:
        share([_TASK], finished, lambda _: fresh() or bool(checkpoint.complete_checkpoints(ckpt_root)), restore,
              claims, log, "checkpoint restores")
    except DataError as e:  # the process that restored failed: the same error here
        raise CheckpointError(str(e)) from None
    finally:
        claims.close()
    if not downloaded and fresh():
        try:
            for line in json.loads(said.read_text()):
                log(str(line))
        except (OSError, ValueError):
            pass


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
    names = sorted({rel.split("/")[0] for rel in listing if STEP_DIR.match(rel.split("/")[0])}, key=step_of)
    latest = store_pointer(store, LATEST)
    complete = 0
    for name in sorted(names, key=lambda n: (n == latest, step_of(n)), reverse=True):
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
    # A name of its own per process: a restore whose owner stopped beating is taken over by another.
    tmp = ckpt_root / f"{name}.download-{process_tag()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _fetch(store, f"{name}/{META_FILE}", tmp / META_FILE)
        try:
            files = json.loads((tmp / META_FILE).read_text())["files"]
            digests = {f: str(info[checkpoint.CHECKSUM]) for f, info in files.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"unreadable meta.json ({e})") from None
        # every name before any byte: a name outside the checkpoint refuses the whole checkpoint
        targets = {f: inside_checkpoint(tmp, f) for f in sorted(files)}
        # Each file is hashed and flushed to disk as soon as it is in, while the others still download.
        with ThreadPoolExecutor(max_workers=max(1, min(len(files), DOWNLOAD_THREADS))) as pool:
            got = dict(zip(targets, pool.map(lambda f: _fetch(store, f"{name}/{f}", targets[f]), targets),
                           strict=True))
        for f in sorted(files):
            if got[f] != digests[f]:
                raise CheckpointError(f"{f} fails its checksum")
        checkpoint.verify(tmp, deep=False)  # sizes and the layout; the checksums were compared above
        try:
            os.rename(tmp, ckpt_root / name)
        except OSError:  # another process put the same checkpoint there first
            pass
        else:  # hashed above as it arrived: the ranks that resume from it need not read it again
            verdict.record(ckpt_root / name, files, None, written_here=True)
    except CheckpointError as e:
        raise CheckpointError(str(e).removeprefix(f"{tmp.name}: ")) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    write_atomic(ckpt_root / LATEST, name + "\n")
    if store_pointer(store, BEST) == name:
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



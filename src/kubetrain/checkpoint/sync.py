"""`kubetrain runs sync`: copy a whole run directory to object storage or back, only the files that changed.

Changed means another size or another xxh3-128 checksum. A push writes .kubetrain-sync.json beside the
files (size and checksum of each), so the next push or pull compares checksums without reading the remote
files; checkpoint files are also known by their checkpoint's meta.json (which is how the files that
training uploaded under `checkpoint.uri` are known). On both sides a checkpoint's meta.json is copied after
its other files and the `latest`/`best` pointers after everything, so an interrupted sync never leaves a
pointer to a partial checkpoint. Nothing is deleted at the destination: it is a backup.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from kubetrain.checkpoint import BEST, CHECKSUM, LATEST, META_FILE, file_digest
from kubetrain.checkpoint.store import Store, describe, is_remote, open_store
from kubetrain.checkpoint.verdict import VERDICTS
from kubetrain.config.names import local_file_path, store_uri_problem
from kubetrain.errors import CheckpointError, KubetrainError, UserInputError
from kubetrain.outside_names import OutsideName, join_inside

MANIFEST = ".kubetrain-sync.json"
_STEP_DIR = re.compile(r"^step-\d{6,}$")
# in-progress files and folders: a checkpoint being written (step-N.tmp), an atomic write (.name.tmpPID),
# a download (.name.PID.tmp), the uploader's hard links (checkpoints/.upload); and a live run's lock
# (runs/lock.py's run.lock: it names a process of the machine it was written on); a restore's claim
# (checkpoints/.restore, checkpoint/restore.py)
_IN_PROGRESS = re.compile(r"\.tmp\d*$|^\.upload$|^run\.lock$|^\.restore$")


@dataclass
class SyncResult:
    direction: str  # push or pull
    copied: list[str] = field(default_factory=list)
    unchanged: int = 0
    nbytes: int = 0


def sync_run(source: str, destination: str, endpoint_url: str | None = None) -> SyncResult:
    """Push a run directory to a URI (`RUN_DIR URI`) or pull one back (`URI RUN_DIR`)."""
    if is_remote(source) and is_remote(destination):
        raise UserInputError("runs sync copies between a run directory and a URI; both arguments are URIs")
    try:
        if is_remote(source):
            return pull(open_store(source, endpoint_url), Path(_local_path(destination)))
        local = Path(_local_path(source))
        if not local.is_dir():
            raise UserInputError(f"no such run directory: {source}")
        return push(local, open_store(destination, endpoint_url))
    except KubetrainError:
        raise
    except OSError as e:  # the store refused (credentials, a denied read), or cannot be reached
        uri = source if is_remote(source) else destination
        raise CheckpointError(f"cannot sync with {uri}: {describe(e)}") from None


def _local_path(text: str) -> str:
    """A run folder given as a path or as a `file:` URI (one that names another host is refused)."""
    if not text.lower().startswith("file:"):
        return text
    path = local_file_path(text)
    if path is None:
        raise UserInputError(store_uri_problem(text) or f"{text!r} is not a path on this machine")
    return path


def _wanted(rel: str) -> bool:
    """Not the manifest, nothing in progress, no verdict (it describes the inodes of this machine)."""
    parts = PurePosixPath(rel).parts
    return rel != MANIFEST and VERDICTS not in parts and not any(_IN_PROGRESS.search(part) for part in parts)


def _stage(rel: str) -> int:
    """Copy order: ordinary files, then each checkpoint's meta.json, then the latest/best pointers."""
    p = PurePosixPath(rel)
    if p.name in (LATEST, BEST) and p.parent.name == "checkpoints":
        return 2
    return 1 if p.name == META_FILE and _STEP_DIR.match(p.parent.name) else 0


def _in_order(rels: list[str]) -> list[list[str]]:
    return [sorted(r for r in rels if _stage(r) == stage) for stage in (0, 1, 2)]


def _remote_digests(store: Store, listing: dict[str, int]) -> dict[str, str]:
    """Checksums of remote files as the manifest and the checkpoints' meta.json files give them."""
    known = {rel: str(info[CHECKSUM]) for rel, info in _manifest(store).items() if CHECKSUM in info}
    for rel in listing:
        p = PurePosixPath(rel)
        if p.name == META_FILE and _STEP_DIR.match(p.parent.name):
            try:
                files = json.loads(store.read_text(rel) or "{}").get("files", {})
            except ValueError:
                continue
            known.update({f"{p.parent}/{f}": info[CHECKSUM] for f, info in files.items() if CHECKSUM in info})
    return known


def _manifest(store: Store) -> dict[str, dict[str, object]]:
    try:
        found = json.loads(store.read_text(MANIFEST) or "{}")
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


def push(root: Path, store: Store) -> SyncResult:
    """Upload the files of `root` that the store lacks or holds with another size or checksum."""
    local = {str(p.relative_to(root).as_posix()): p.stat().st_size for p in root.rglob("*") if p.is_file()}
    local = {rel: size for rel, size in local.items() if _wanted(rel)}
    remote = store.sizes()
    known = _remote_digests(store, remote)
    digests = {rel: file_digest(root / rel) for rel in local}
    todo = [rel for rel in local if remote.get(rel) != local[rel] or known.get(rel) != digests[rel]]
    for batch in _in_order(todo):
        store.put([(root / rel, rel) for rel in batch])
    manifest = {rel: info for rel, info in _manifest(store).items() if rel in remote}
    manifest.update({rel: {"bytes": local[rel], CHECKSUM: digests[rel]} for rel in local})
    store.write_text(MANIFEST, json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return SyncResult("push", sorted(todo), len(local) - len(todo), sum(local[r] for r in todo))


def pull(store: Store, root: Path) -> SyncResult:
    """Download the files of the store that `root` lacks or holds with another size or checksum.

    Each file is written under a temporary name, checked against its known checksum, and renamed.
    """
    if root.exists() and not root.is_dir():
        raise UserInputError(f"{root} is not a folder")
    remote = {rel: size for rel, size in store.sizes().items() if _wanted(rel)}
    if not remote:
        raise UserInputError(f"nothing to pull at {store.uri}")
    targets: dict[str, Path] = {}
    for rel in remote:  # every key before any byte: a store that names anything outside `root` is refused whole
        try:
            targets[rel] = join_inside(root, rel)
        except OutsideName as e:
            raise UserInputError(f"{store.uri} lists {rel!r}, which would land outside {root} ({e.why}); nothing "
                                 f"was pulled") from None
    known = _remote_digests(store, remote)
    todo = []
    for rel, size in remote.items():
        p = targets[rel]
        same = p.is_file() and p.stat().st_size == size and rel in known and file_digest(p) == known[rel]
        if not same:
            todo.append(rel)
    for batch in _in_order(todo):
        parts = [(rel, targets[rel].with_name(f".{targets[rel].name}.{os.getpid()}.tmp")) for rel in batch]
        try:
            store.get(parts)
            for rel, tmp in parts:
                if rel in known and file_digest(tmp) != known[rel]:
                    raise CheckpointError(
                        f"{store.uri}/{rel} does not match its recorded checksum; {targets[rel]} was left as it was"
                    )
            for rel, tmp in parts:
                os.replace(tmp, targets[rel])
        finally:
            for _, tmp in parts:
                tmp.unlink(missing_ok=True)
    return SyncResult("pull", sorted(todo), len(remote) - len(todo), sum(remote[r] for r in todo))

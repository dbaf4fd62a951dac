"""Copy a run directory from a pod's claim to a local folder, only what changed, checkpoints whole and verified.

The pod runs fetch/program.py (through a `Transport`: exec in a pod, or a local process on a simulated claim).
What changed: another size or modification time than the copy recorded in `.kubetrain-fetch.json` (reading
every file in the pod to checksum it would cost as much as copying it). Checkpoints are copied whole into
`checkpoints/step-N.fetch.tmp/`, verified against the xxh3-128 checksums of their own meta.json, and only then
renamed into place; the `latest`/`best` pointers are written last and only name checkpoints that are here.
An interrupted fetch leaves `*.fetch.tmp` names only, which every reader skips and the next fetch removes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import IO, Any, Protocol

from kubetrain import checkpoint
from kubetrain.checkpoint import BEST, LATEST, META_FILE
from kubetrain.errors import CheckpointError, KubetrainError, UserInputError
from kubetrain.files import write_atomic
from kubetrain.k8s.fetch.mlflow_store import (
    LOCAL_DIR,
    STORE_FILE,
    STORE_KEY,
    StorePlan,
    integrity_problem,
    plan_store,
    rewrite_locations,
)
from kubetrain.k8s.fetch.program import (
    NOTES,
    STORE_MEMBER,
    command,
    list_args,
    store_list_args,
    store_tar_args,
    tar_args,
)
from kubetrain.outside_names import OutsideName, join_inside

MANIFEST = ".kubetrain-fetch.json"
TMP = ".fetch.tmp"
CHOICES = ("latest", "best", "all", "none")
_CKPT = re.compile(r"^(?P<dir>(?:.*/)?checkpoints/step-\d{6,})/(?P<file>.+)$")
_POINTER = re.compile(r"^(?:.*/)?checkpoints/(?:latest|best)$")
_STEP_NAME = re.compile(r"^step-\d{6,}$")
Log = Callable[[str], None]


class FetchError(KubetrainError):
    """The pod could not read the run directory, or a copied checkpoint failed its checksums. Exit code 1."""


class Transport(Protocol):
    def run(self, args: list[str]) -> AbstractContextManager[IO[bytes]]:
        """Run the pod program with these arguments; its stdout while open, its exit checked on close."""


class LocalTransport:
    """Runs the fetch program as a local process, on a folder of this machine (a simulated claim)."""

    @contextmanager
    def run(self, args: list[str]) -> Iterator[IO[bytes]]:
        proc = subprocess.Popen(command(sys.executable, args), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.stdout is not None and proc.stderr is not None
        try:
            yield proc.stdout
            proc.stdout.read()  # what the reader left (a tar's end padding)
        finally:
            proc.stdout.close()
            err = proc.stderr.read().decode(errors="replace").strip()
            code = proc.wait()
        if code != 0:
            raise FetchError(err.splitlines()[-1] if err else f"the fetch program exited with {code}")


@dataclass
class FetchResult:
    copied: list[str] = field(default_factory=list)  # files, relative to the run directory
    checkpoints: list[str] = field(default_factory=list)  # checkpoint folders copied and verified
    unchanged: int = 0
    nbytes: int = 0
    failed: list[str] = field(default_factory=list)  # "step-N: why"
    mlflow_runs: list[str] = field(default_factory=list)  # MLflow run ids of this run whose store came along
    mlflow_store: Path | None = None  # the fetched copy of the job's MLflow store
    warnings: list[str] = field(default_factory=list)  # what was not fetched, and why


@dataclass
class _Plan:
    listing: dict[str, tuple[int, int]]
    pointers: dict[str, str]
    plain: list[str]
    checkpoints: dict[str, list[str]]  # checkpoint folder -> its files, meta.json last
    unchanged: int  # files asked for that are here as the pod has them

    @property
    def files(self) -> list[str]:
        return self.plain + [f"{d}/{f}" for d, files in self.checkpoints.items() for f in files]


def _load_manifest(local: Path) -> dict[str, list[int]]:
    try:
        found = json.loads((local / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _chosen(listing: dict[str, tuple[int, int]], pointers: dict[str, str], which: str) -> set[str]:
    """The checkpoint folders `--checkpoints` asks for: in each checkpoints/ folder, complete ones only."""
    complete = {m["dir"] for rel in listing if (m := _CKPT.match(rel)) and m["file"] == META_FILE}
    if which == "all":
        return complete
    if which == "none":
        return set()
    out = set()
    for folder in {str(PurePosixPath(d).parent) for d in complete}:
        name = pointers.get(f"{folder}/{which}") or (pointers.get(f"{folder}/{LATEST}") if which == BEST else None)
        if name and f"{folder}/{name}" in complete:
            out.add(f"{folder}/{name}")
    return out


def plan(listing_json: dict[str, Any], local: Path, which: str) -> _Plan:
    listing = {str(rel): (int(size), int(mtime)) for rel, size, mtime in listing_json["files"]}
    pointers = {str(k): str(v) for k, v in listing_json["pointers"].items()}
    for rel in [*listing, *pointers]:  # every name before any byte: a pod that names anything outside is refused
        _safe(rel, local)
    pointers = {k: v for k, v in pointers.items() if _STEP_NAME.match(v)}  # a pointer names a step folder, or nothing
    manifest = _load_manifest(local)

    def changed(rel: str) -> bool:
        return manifest.get(rel) != list(listing[rel])

    candidates = [rel for rel in listing if not _CKPT.match(rel) and not _POINTER.match(rel)]
    plain = [rel for rel in candidates if changed(rel) or not (local / rel).is_file()]
    unchanged = len(candidates) - len(plain)
    checkpoints: dict[str, list[str]] = {}
    for folder in sorted(_chosen(listing, pointers, which)):
        files = sorted(m["file"] for rel in listing if (m := _CKPT.match(rel)) and m["dir"] == folder)
        if (local / folder).is_dir() and not changed(f"{folder}/{META_FILE}"):
            unchanged += len(files)  # a checkpoint never changes once complete: same meta.json, same checkpoint
            continue
        checkpoints[folder] = [f for f in files if f != META_FILE] + [META_FILE]
    return _Plan(listing, pointers, sorted(plain), checkpoints, unchanged)


def fetch_run(transport: Transport, remote_root: str, local: Path, which: str = "latest",
              log: Log | None = None, mlflow_db: str | None = None) -> FetchResult:
    """Copy the run directory at `remote_root` (a path in the pod) into `local`; with `mlflow_db` (the path in the
    pod of the job's MLflow SQLite store), also that store and this run's artifacts into `local`/mlflow/."""
    if which not in CHOICES:
        raise UserInputError(f"--checkpoints must be one of {', '.join(CHOICES)}, not '{which}'")
    say = log or (lambda _line: None)
    local.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(local)
    with transport.run(list_args(remote_root)) as out:
        raw = out.read()  # parsed once the program's exit was checked
    todo = plan(json.loads(raw), local, which)
    result = FetchResult(unchanged=todo.unchanged)
    if todo.files:
        say(f"copying {len(todo.files)} files ({len(todo.checkpoints)} checkpoints) from {remote_root}")
        try:
            with transport.run(tar_args(remote_root, todo.files)) as out:
                notes = _Unpacker(local, result).unpack(out)
        finally:
            _remove_leftovers(local)
        _record(local, todo, result, notes)
    _point(local, todo)
    if mlflow_db is not None:
        _fetch_store(transport, remote_root, mlflow_db, local, result, say)
    return result


def _fetch_store(transport: Transport, remote_root: str, db: str, local: Path, result: FetchResult,
                 say: Log) -> None:
    """The MLflow store (copied whole when it changed, read through SQLite's backup API in the pod) and the
    artifacts of this run that changed, into local/mlflow/ laid out as the pod's output dir is."""
    base = str(PurePosixPath(remote_root).parent)
    with transport.run(store_list_args(remote_root, base, db)) as out:
        raw = out.read()
    listing = json.loads(raw)
    if listing["db"] is None:
        result.warnings.append(f"MLflow: no store at {db} (the job has not logged to it yet)")
        return
    manifest = _load_manifest(local)
    todo = plan_store(listing, local, manifest)
    result.warnings += todo.warnings
    result.unchanged += todo.unchanged
    result.mlflow_runs = todo.runs
    if todo.db or todo.files:
        say(f"copying the MLflow store{'' if todo.db else ' artifacts'} ({len(todo.files)} artifact files)")
        try:
            with transport.run(store_tar_args(remote_root, base, db, todo.db, todo.files)) as out:
                notes = _unpack_store(out, local, [listing["base"], base], result)
        finally:
            _remove_leftovers(local)
        skipped = set(notes.get("gone", [])) | set(notes.get("changed", []))
        if notes.get("error"):
            result.warnings.append(f"MLflow store not copied: {notes['error']}")
        _record_store(local, listing, todo, result, skipped)
    store = local / LOCAL_DIR / STORE_FILE
    result.mlflow_store = store if store.is_file() else None


def _unpack_store(stream: IO[bytes], local: Path, pod_bases: list[str], result: FetchResult) -> dict[str, Any]:
    """Each member under a temporary name, then renamed; the store is checked and its artifact locations
    pointed at local/mlflow/ before it replaces the previous copy."""
    here = local / LOCAL_DIR
    notes: dict[str, Any] = {}
    for name, source, size in _members(stream):
        if name == NOTES:
            notes = json.loads(source.read())
            continue
        rel = _safe(name, here)
        final = here / rel
        tmp = final.with_name(f".{final.name}{TMP}")
        _write_synced(source, tmp)
        result.nbytes += size
        if name == STORE_MEMBER:
            problem = integrity_problem(tmp)
            if problem is not None:
                result.warnings.append(f"MLflow store not kept: the copy fails its integrity check: {problem}")
                tmp.unlink()
                continue
            rewrite_locations(tmp, pod_bases, here)
        os.replace(tmp, final)
        result.copied.append(f"{LOCAL_DIR}/{rel}")
    return notes


def _record_store(local: Path, listing: dict[str, Any], todo: StorePlan, result: FetchResult,
                  skipped: set[str]) -> None:
    manifest = _load_manifest(local)
    stamps = {f"{LOCAL_DIR}/{rel}": [size, mtime] for rel, size, mtime in listing["files"]}
    for rel in result.copied:
        if rel == STORE_KEY and todo.db:
            manifest[rel] = listing["db"]
        elif rel in stamps and rel.removeprefix(f"{LOCAL_DIR}/") not in skipped:
            manifest[rel] = stamps[rel]
    write_atomic(local / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True) + "\n")


class _Unpacker:
    """Writes the members of the tar stream: plain files under temporary names then renamed, checkpoints into
    a temporary folder that is verified and renamed when its last file (meta.json) is in."""

    def __init__(self, local: Path, result: FetchResult) -> None:
        self.local, self.result = local, result

    def unpack(self, stream: IO[bytes]) -> dict[str, list[str]]:
        notes: dict[str, list[str]] = {"gone": [], "changed": []}
        for name, source, size in _members(stream):
            if name == NOTES:
                notes = json.loads(source.read())
                continue
            rel = _safe(name, self.local)
            m = _CKPT.match(rel)
            target = (self.local / f"{m['dir']}{TMP}" / m["file"]) if m else self._tmp_name(rel)
            _write_synced(source, target)
            self.result.nbytes += size
            if m is None:
                os.replace(target, self.local / rel)
                self.result.copied.append(rel)
            elif m["file"] == META_FILE:
                self._finish_checkpoint(m["dir"])
        return notes

    def _tmp_name(self, rel: str) -> Path:
        path = self.local / rel
        return path.with_name(f".{path.name}{TMP}")

    def _finish_checkpoint(self, folder: str) -> None:
        tmp, final = self.local / f"{folder}{TMP}", self.local / folder
        try:
            checkpoint.verify(tmp, deep=True)
        except CheckpointError as e:
            self.result.failed.append(f"{folder}: {str(e).removeprefix(f'{tmp.name}: ')}")
            shutil.rmtree(tmp, ignore_errors=True)
            return
        shutil.rmtree(final, ignore_errors=True)  # an older copy that the job has since rewritten
        os.rename(tmp, final)
        self.result.checkpoints.append(folder)
        self.result.copied += [str(p.relative_to(self.local).as_posix()) for p in final.rglob("*") if p.is_file()]


def _safe(name: str, folder: Path) -> str:
    """A name the pod sent (listed, or a member of its archive), checked to stay inside `folder`: the pod is not
    trusted with ../, absolute paths or a link. Anything else refuses the fetch (exit 2)."""
    try:
        join_inside(folder, name)
    except OutsideName as e:
        raise UserInputError(f"the pod sent {name!r}, which would land outside {folder} ({e.why}); the fetch "
                             f"stopped there") from None
    return name


def _remove_leftovers(local: Path) -> None:
    """What an interrupted fetch left: temporary files and checkpoint folders."""
    for path in list(local.rglob(f"*{TMP}")):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def _record(local: Path, todo: _Plan, result: FetchResult, notes: dict[str, list[str]]) -> None:
    """Remember the size and time of each file copied whole, so the next fetch skips it while it is unchanged."""
    manifest = _load_manifest(local)
    skipped = set(notes.get("gone", [])) | set(notes.get("changed", []))
    for rel in result.copied:
        if rel in todo.listing and rel not in skipped:
            manifest[rel] = list(todo.listing[rel])
    write_atomic(local / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def _point(local: Path, todo: _Plan) -> None:
    """latest/best in each checkpoints/ folder, naming only checkpoints that are here.

    `latest` follows the job where that checkpoint was copied, else names the newest one here (so `generate` and
    `--resume auto` find one after `--checkpoints best`); `best` follows the job where it can.
    """
    folders = {str(PurePosixPath(rel).parent) for rel in todo.pointers}
    folders |= {str(PurePosixPath(d).parent) for d in todo.checkpoints}
    for folder in folders:
        root = local / folder
        here = checkpoint.complete_checkpoints(root)
        if not here:
            continue
        for which in (LATEST, BEST):
            name = todo.pointers.get(f"{folder}/{which}")
            if name and (root / name).is_dir():
                write_atomic(root / which, name + "\n")
            elif which == LATEST and checkpoint.pointer(root, LATEST) not in {p.name for p in here}:
                write_atomic(root / LATEST, here[-1].name + "\n")


def _members(stream: IO[bytes]) -> Iterator[tuple[str, IO[bytes], int]]:
    """(name, contents, size) of each file of a tar stream, read in order (the stream cannot seek)."""
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        for member in tar:
            if not member.isfile():  # the pod program sends files only: a link or a device is not followed
                raise UserInputError(f"the pod sent {member.name!r}, which is not a plain file; the fetch stopped "
                                     "there")
            source = tar.extractfile(member)
            if source is not None:
                yield member.name, source, member.size


def _write_synced(source: IO[bytes], target: Path) -> None:
    """Copy `source` into `target` (its folder made) and fsync it, so a rename after it publishes whole bytes."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "wb") as f:
        shutil.copyfileobj(source, f, 1 << 20)
        os.fsync(f.fileno())

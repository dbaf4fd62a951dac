"""A checkpoint is hashed once, not once per rank and per start: whoever verifies it records the verdict.

At 64 nodes × 8 ranks, every rank hashing every file of the checkpoint it resumes is 512 full reads of it over
the network. Instead the first process to verify a checkpoint takes a lock in its folder (the others wait on
that lock: a file-system wait, never a collective), hashes every file, and writes the verdict into
checkpoints/.verified/<name>.json (beside the checkpoint, not in it: a checkpoint folder holds what its meta.json
lists): the outcome and, for meta.json and each listed file, its size, mtime (ns) and inode. A verdict holds while all
of those are unchanged, so the other ranks, a restarted worker and the FSDP optimizer load read it instead of
the files. The rule and its limit are the same as for data files (data/fingerprints.py): files modified less
than RACY_SECONDS before the hash get no verdict (a write in the same mtime tick would go unseen), and damage
that keeps a file's size, mtime and inode (bit rot in place) is not seen after the first verification.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kubetrain import locks
from kubetrain.checkpoint.layout import CHECKSUM, META_FILE, file_digest
from kubetrain.files import write_atomic

VERDICTS = ".verified"  # in the checkpoints folder: <name>.json verdicts, <name>.lock locks
RACY_SECONDS = 2.0
# Only finished checkpoint folders get a verdict: a download or a fetch verifies its temporary folder alone.
_STEP_DIR = re.compile(r"^step-\d{6,}$")


def _verdict_file(folder: Path) -> Path:
    return folder.parent / VERDICTS / f"{folder.name}.json"


def _shared(folder: Path) -> bool:
    return bool(_STEP_DIR.match(folder.name))


def _stamp(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _stamps(folder: Path, files: dict[str, Any]) -> dict[str, list[Any]]:
    """What a verdict records: meta.json's stamp and, per listed file, its stamp and expected digest."""
    found: dict[str, list[Any]] = {META_FILE: _stamp(folder / META_FILE)}
    for name, info in files.items():
        found[name] = [*_stamp(folder / name), info.get(CHECKSUM)]
    return found


def recorded(folder: Path, files: dict[str, Any]) -> tuple[bool, str | None]:
    """(True, problem or None) when a verdict holds for the files as they are now; (False, None) otherwise."""
    if not _shared(folder):
        return False, None
    try:
        verdict = json.loads(_verdict_file(folder).read_text())
        holds = isinstance(verdict, dict) and verdict.get("stamps") == _stamps(folder, files)
    except (OSError, ValueError):
        return False, None
    return (True, verdict.get("problem")) if holds else (False, None)


def record(folder: Path, files: dict[str, Any], problem: str | None, *, written_here: bool = False) -> None:
    """Write the verdict of a hash just done (nothing for files too new to trust their mtime, or read-only).

    `written_here`: this process wrote the files and hashed them after (a download), nothing else writes them.
    """
    if not _shared(folder):
        return
    with contextlib.suppress(OSError):
        stamps = _stamps(folder, files)
        if not written_here and time.time() - max(s[1] for s in stamps.values()) / 1e9 <= RACY_SECONDS:
            return
        _verdict_file(folder).parent.mkdir(exist_ok=True)
        write_atomic(_verdict_file(folder), json.dumps({"stamps": stamps, "problem": problem}))
        for old in _verdict_file(folder).parent.glob("*.json"):  # those of pruned checkpoints
            if not (folder.parent / old.stem).is_dir():
                old.unlink(missing_ok=True)


@contextlib.contextmanager
def exclusive(folder: Path) -> Iterator[None]:
    """One process at a time verifies `folder` (kubetrain.locks: flock, or a lock file where the file system has
    no flock); where no lock can be taken (a read-only folder), no lock."""
    if not _shared(folder):
        yield
        return
    with contextlib.ExitStack() as held:
        try:
            lock = _verdict_file(folder).with_suffix(".lock")
            lock.parent.mkdir(exist_ok=True)
            held.enter_context(locks.exclusive(lock))
        except OSError:
            pass  # read-only: verify without the lock
        yield


HASH_THREADS = 8  # at most: a meta.json from elsewhere may list any number of files


def hashed(path: Path, files: dict[str, Any]) -> str | None:
    """What is wrong with the files' bytes (None: nothing), hashed by one process and recorded for the others."""
    held, problem = recorded(path, files)
    if held:
        return problem
    with exclusive(path):  # another rank may be hashing it right now: wait for its verdict
        held, problem = recorded(path, files)
        if held:
            return problem
        with ThreadPoolExecutor(max_workers=max(1, min(len(files), HASH_THREADS))) as pool:
            digests = dict(zip(files, pool.map(file_digest, (path / f for f in files)), strict=True))
        problem = next((f"{f} fails its checksum" for f, info in files.items() if digests[f] != info.get(CHECKSUM)),
                       None)
        record(path, files, problem)
    return problem

"""Content digests of data files, remembered by (path, size, mtime, inode), so an unchanged corpus is known at once.

Finding a prepared shard means hashing the corpus; a 10 GB corpus takes minutes to read. The digests are kept
in <cache>/fingerprints.json: a file whose path, size, mtime and inode are unchanged is not read again. One
process hashes what is missing while the others wait on a lock, then find its digests there.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import xxhash

from kubetrain.locks import exclusive

FINGERPRINTS_FILE = "fingerprints.json"
# A file changed within the same mtime tick as it was hashed would keep a stale digest ("racy git"):
# files modified this recently are hashed every time until they are older.
RACY_SECONDS = 2.0


def file_digest(path: Path) -> str:
    """xxh3-128 of a file's bytes, read in blocks (~10 GB/s, the disk is the limit).

    Not memory-mapped: a mapped file's pages count in the process's resident memory, and a start-up that
    hashes a 100 GB corpus must not look like (or be killed as) a process that holds 100 GB.
    """
    h = xxhash.xxh3_128()
    block = bytearray(_BLOCK)
    view = memoryview(block)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(block):
            h.update(view[:n])
    return h.hexdigest()


_BLOCK = 8 << 20


class DigestCache:
    """Digests of files under a cache folder; `None` as the folder means no cache (every file is read)."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder
        self.hashed: list[Path] = []  # the files this cache had to read (for logs and tests)

    def digests(self, files: list[Path]) -> list[str]:
        """The digest of each file, reading only those whose fingerprint is new."""
        if self.folder is None:
            return [self._read(f) for f in files]
        stats = {f: _stat_key(f) for f in files}
        known = self._load()
        if any(known.get(k) is None for k in stats.values()):
            with exclusive(self.folder / f".{FINGERPRINTS_FILE}.lock"):
                known = self._load()  # another process may have hashed them while this one waited
                missing = [f for f, k in stats.items() if known.get(k) is None]
                fresh = {stats[f]: self._read(f) for f in missing}
                now = time.time()
                stable = {k: d for (k, d), f in zip(fresh.items(), missing, strict=True)
                          if now - f.stat().st_mtime > RACY_SECONDS}
                if stable:
                    self._save({**known, **stable})
                known = {**known, **fresh}
        return [known[stats[f]] for f in files]

    def _read(self, f: Path) -> str:
        self.hashed.append(f)
        return file_digest(f)

    def _load(self) -> dict[str, str]:
        assert self.folder is not None
        try:
            raw: Any = json.loads((self.folder / FINGERPRINTS_FILE).read_text())
        except (OSError, ValueError):
            return {}
        return raw if isinstance(raw, dict) else {}

    def _save(self, entries: dict[str, str]) -> None:
        assert self.folder is not None
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.folder / f".{FINGERPRINTS_FILE}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(entries, sort_keys=True))
        os.replace(tmp, self.folder / FINGERPRINTS_FILE)


def _stat_key(f: Path) -> str:
    st = f.stat()
    return f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"

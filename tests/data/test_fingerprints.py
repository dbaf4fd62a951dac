"""File digests remembered by (path, size, mtime, inode): an unchanged corpus is not read again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import xxhash

from kubetrain.data.fingerprints import FINGERPRINTS_FILE, DigestCache, file_digest
from tests.conftest import cli_env


def settled(path: Path, data: bytes) -> Path:
    """A file written, then dated a minute back (older than the racy window)."""
    path.write_bytes(data)
    old = time.time() - 60
    os.utime(path, (old, old))
    return path


def test_file_digest_is_xxh3_128_of_the_bytes(tmp_path: Path) -> None:
    data = os.urandom(3 << 20)
    assert file_digest(settled(tmp_path / "a", data)) == xxhash.xxh3_128_hexdigest(data)
    assert file_digest(settled(tmp_path / "empty", b"")) == xxhash.xxh3_128_hexdigest(b"")


def test_known_files_are_not_read_again(tmp_path: Path) -> None:
    files = [settled(tmp_path / f"{i}.txt", f"text {i}".encode()) for i in range(3)]
    index = tmp_path / "index"
    first = DigestCache(index)
    digests = first.digests(files)
    assert first.hashed == files and digests == [file_digest(f) for f in files]
    again = DigestCache(index)  # a new process: only the fingerprints file is read
    assert again.digests(files) == digests and again.hashed == []
    settled(files[1], b"changed")  # new size and content
    after = DigestCache(index)
    assert after.digests(files)[1] == file_digest(files[1]) and after.hashed == [files[1]]
    assert len(json.loads((index / FINGERPRINTS_FILE).read_text())) == 4  # old entries stay; harmless


def test_files_changed_just_now_are_hashed_until_they_settle(tmp_path: Path) -> None:
    fresh = tmp_path / "fresh.txt"
    fresh.write_text("being written")
    for _ in range(2):
        cache = DigestCache(tmp_path / "index")
        cache.digests([fresh])
        assert cache.hashed == [fresh]  # an mtime this recent could hide a same-size rewrite


def test_without_a_folder_every_file_is_read(tmp_path: Path) -> None:
    f = settled(tmp_path / "a", b"x")
    cache = DigestCache(None)
    cache.digests([f])
    cache.digests([f])
    assert cache.hashed == [f, f]


def test_processes_started_together_hash_each_file_once(tmp_path: Path) -> None:
    files = [settled(tmp_path / f"part{i}", os.urandom(4 << 20)) for i in range(4)]
    script = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from kubetrain.data.fingerprints import DigestCache\n"
        "cache = DigestCache(Path(sys.argv[1]))\n"
        "cache.digests([Path(p) for p in sys.argv[2:]])\n"
        "print(json.dumps(len(cache.hashed)))\n"
    )
    args = [sys.executable, "-c", script, str(tmp_path / "index"), *map(str, files)]
    procs = [subprocess.Popen(args, env=cli_env(), stdout=subprocess.PIPE, text=True) for _ in range(3)]
    counts = [int(p.communicate(timeout=120)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sum(counts) == len(files)  # one process read them; the others waited and found the digests

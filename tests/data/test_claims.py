"""Work shared through a folder: one owner per task, dead owners replaced, failures seen by every process."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kubetrain.data.claims import Claims, share
from kubetrain.errors import DataError


def test_a_task_has_one_owner_until_its_heartbeat_stops(tmp_path: Path) -> None:
    a, b = Claims(tmp_path / "claims"), Claims(tmp_path / "claims")
    try:
        assert a.claim("part-00000") and not b.claim("part-00000")
        old = time.time() - 120  # its owner died two minutes ago
        os.utime(tmp_path / "claims" / "part-00000", (old, old))
        assert b.claim("part-00000")
    finally:
        a.close()
        b.close()


def test_share_does_what_nobody_alive_does_and_skips_what_is_done(tmp_path: Path) -> None:
    done_dir = tmp_path / "done"
    done_dir.mkdir()
    (done_dir / "t1").touch()  # finished by another process
    claims = Claims(tmp_path / "claims")
    (tmp_path / "claims" / "t2").write_text("a dead process")
    old = time.time() - 120
    os.utime(tmp_path / "claims" / "t2", (old, old))
    did: list[str] = []

    def do(task: str) -> None:
        did.append(task)
        (done_dir / task).touch()

    share(["t0", "t1", "t2"], lambda: set(os.listdir(done_dir)), lambda t: (done_dir / t).exists(), do, claims)
    claims.close()
    assert sorted(did) == ["t0", "t2"]
    assert os.listdir(tmp_path / "claims") == []  # nothing held any more


def test_a_failure_stops_the_processes_that_wait_for_the_task(tmp_path: Path) -> None:
    first, second = Claims(tmp_path / "c"), Claims(tmp_path / "c")

    def bad(task: str) -> None:
        raise DataError("corpus.txt: not UTF-8 text")

    with pytest.raises(DataError, match="not UTF-8"):
        share(["t"], set, lambda t: False, bad, first)
    with pytest.raises(DataError, match="not UTF-8"):  # the same error, without doing the task again
        share(["t"], set, lambda t: False, lambda t: pytest.fail("done twice"), second)
    # a process started after the failure was recorded tries again (the cause may be gone)
    time.sleep(1.1)
    later, did = Claims(tmp_path / "c"), list[str]()
    later.started = time.time()
    share(["t"], lambda: set(did), lambda t: False, did.append, later)
    assert did == ["t"]
    for c in (first, second, later):
        c.close()

"""FSDP checkpoints written in the background (checkpoint.async_save through DCP's async_save), on 2 gloo ranks:
the same files as a synchronous save, a SIGKILL mid-save keeps the previous checkpoint, and the resume is exact."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest

from kubetrain import checkpoint
from kubetrain.checkpoint.safe_dcp import load_metadata
from tests.launch.test_elastic import _train_losses as _losses
from tests.launch.test_elastic import _workers
from tests.train.conftest import kubetrain, sets, start

pytestmark = pytest.mark.slow

STEPS = 12
# wider than TINY: a save lasts long enough (tens of ms) for the kill to land inside one
COMMON = (f"train.max_steps={STEPS}", "checkpoint.every_steps=2", "checkpoint.keep_last=2", "eval.every_steps=4",
          "train.log_every_steps=2", "model.n_embd=128", "dist.strategy=fsdp")


def _args(name: str, cache: Path, *extra: str) -> list[str]:
    return ["train", *sets(f"run.name={name}", f"data.cache_dir={cache}", *COMMON, *extra), "--nproc", "2"]


def _checkpoint_lines(run: Path) -> list[dict[str, Any]]:
    records = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    return [r for r in records if r["kind"] == "checkpoint"]


def _rank(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:  # it ended meanwhile
        return None
    return int(next(v for v in env if v.startswith(b"RANK=")).split(b"=", 1)[1])


@pytest.fixture(scope="module")
def background(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """An uninterrupted 2-rank FSDP run whose checkpoints are written in the background (the default)."""
    cwd = tmp_path_factory.mktemp("async")
    kubetrain(*_args("async", cwd / "cache"), cwd=cwd)
    return cwd / "runs" / "async", cwd / "cache"


@pytest.mark.ci  # a heavy end-to-end proof (many processes): .ci/run runs it, not the README's test command
def test_background_fsdp_checkpoints_are_the_files_a_synchronous_save_writes(
    background: tuple[Path, Path], tmp_path: Path
) -> None:
    run, cache = background
    kubetrain(*_args("sync", cache, "checkpoint.async_save=false"), cwd=tmp_path)
    sync = tmp_path / "runs" / "sync"
    lines = _checkpoint_lines(run)
    assert [r["step"] for r in lines] == list(range(2, STEPS + 1, 2))  # every save recorded, in step order
    assert all(r["blocked_seconds"] > 0 and r["write_seconds"] > 0 for r in lines)
    for step in (STEPS - 2, STEPS):  # the last one is synchronous in both runs (the end of training)
        name = checkpoint.step_name(step)
        mine, theirs = checkpoint.verify(run / "checkpoints" / name), checkpoint.verify(sync / "checkpoints" / name)
        files, their_files = dict(mine.meta["files"]), dict(theirs.meta["files"])
        assert "shards/__1_0.distcp" in files
        # DCP's .metadata names its folder and a random save id: the same index of the same tensors is what counts
        index = "shards/.metadata"
        files.pop(index), their_files.pop(index)
        ours, sync_index = load_metadata(mine.path / index), load_metadata(theirs.path / index)
        assert ours.state_dict_metadata == sync_index.state_dict_metadata
        assert ours.storage_data == sync_index.storage_data
        # every other file (trainer state, both ranks' shards of the model and optimizer) has the same bytes
        assert files == their_files
    assert _losses(run) == _losses(sync)


@pytest.mark.ci  # a heavy end-to-end proof (many processes): .ci/run runs it, not the README's test command
def test_sigkill_during_a_background_fsdp_save_keeps_the_previous_checkpoint_and_resumes_exactly(
    background: tuple[Path, Path], tmp_path: Path
) -> None:
    reference, cache = background
    run = tmp_path / "runs" / "killed"
    ckpts = run / "checkpoints"
    killed_during: list[str] = []
    for _ in range(5):  # the save overlaps the next steps; poll for a temporary folder after a first checkpoint
        proc = start(*_args("killed", cache), "--max-restarts", "0", cwd=tmp_path)
        while proc.poll() is None and not killed_during:
            torn = [p.name for p in ckpts.glob("*.tmp")] if (ckpts / "latest").exists() else []
            if torn and torn[0] != checkpoint.step_name(STEPS) + ".tmp":  # not the final, synchronous save
                rank0 = [p for p in _workers(proc.pid) if _rank(p) == 0]
                if rank0:
                    os.kill(rank0[0], signal.SIGKILL)  # the rank that finishes the checkpoint
                    killed_during = torn
        proc.communicate(timeout=300)
        if killed_during:
            break
        shutil.rmtree(run)  # finished before a kill landed: start afresh
    assert killed_during, "never caught a background save in flight"
    assert proc.returncode != 0
    latest = (ckpts / "latest").read_text().strip()
    assert latest + ".tmp" not in killed_during
    checkpoint.verify(ckpts / latest)  # `latest` names a whole checkpoint whose every file matches its checksum

    kubetrain(*_args("killed", cache), cwd=tmp_path)
    final = checkpoint.step_name(STEPS)
    mine, theirs = (checkpoint.verify(r / "checkpoints" / final).model_state() for r in (run, reference))
    assert mine.keys() == theirs.keys() and all(mine[k].equal(theirs[k]) for k in theirs)
    assert _losses(run) == _losses(reference)

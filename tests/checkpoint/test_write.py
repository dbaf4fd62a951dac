"""checkpoint.write: atomic saves, checksums, pointers, pruning; a failed save keeps the previous checkpoint."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from kubetrain import checkpoint
from kubetrain.checkpoint import write
from kubetrain.errors import CheckpointError
from tests.checkpoint.conftest import save_step, tiny_state


def test_save_writes_files_pointers_and_checksums(tmp_path: Path) -> None:
    ck = save_step(tmp_path, 5, best=True)
    assert ck.path.name == "step-000005"
    assert sorted(p.name for p in ck.path.iterdir()) == [
        "meta.json", "model.safetensors", "trainer.pt", "trainer.safetensors"]
    assert checkpoint.pointer(tmp_path, "latest") == "step-000005"
    assert checkpoint.pointer(tmp_path, "best") == "step-000005"
    meta = json.loads((ck.path / "meta.json").read_text())
    assert meta["step"] == 5 and meta["tokens"] == 50
    assert set(meta["files"]) == {"model.safetensors", "trainer.pt", "trainer.safetensors"}
    # tied weights are stored once
    assert set(meta["shapes"]) == {"embed.weight", "norm.weight"}
    loaded = checkpoint.verify(ck.path)
    assert torch.equal(loaded.model_state()["embed.weight"], tiny_state(5)["embed.weight"])
    assert loaded.trainer_state()["step"] == 5
    assert loaded.trainer_state()["rng"][0].equal(torch.get_rng_state())


def test_keep_last_prunes_but_keeps_best(tmp_path: Path) -> None:
    save_step(tmp_path, 1, best=True)
    for step in (2, 3, 4):
        save_step(tmp_path, step)
    names = [p.name for p in checkpoint.complete_checkpoints(tmp_path)]
    assert names == ["step-000001", "step-000003", "step-000004"]
    assert checkpoint.pointer(tmp_path, "best") == "step-000001"


def test_resave_of_same_step_replaces_it(tmp_path: Path) -> None:
    save_step(tmp_path, 3)
    again = save_step(tmp_path, 3)
    assert checkpoint.verify(again.path).step == 3
    assert [p.name for p in checkpoint.complete_checkpoints(tmp_path)] == ["step-000003"]


def test_unwritable_folder_fails_clearly_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    save_step(tmp_path, 1)
    # Root ignores permission bits, so make the folder unwritable by putting a file where the save needs a dir.
    (tmp_path / "step-000002.tmp").write_text("in the way")
    os.chmod(tmp_path, 0o500)
    try:
        with pytest.raises(CheckpointError, match="could not save checkpoint step-000002"):
            checkpoint.save(tmp_path, 2, tiny_state(), {"x": 1}, {}, keep_last=2)
    finally:
        os.chmod(tmp_path, 0o700)
    assert checkpoint.pointer(tmp_path, "latest") == "step-000001"
    assert checkpoint.find_resumable(tmp_path).step == 1  # type: ignore[union-attr]


@contextlib.contextmanager
def _small_filesystem(path: Path, size: str) -> object:
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, check=False).returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], check=False)


def test_full_disk_fails_clearly_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "small"
    with _small_filesystem(root, "160k") as mounted:
        if not mounted:
            pytest.skip("mounting a tmpfs needs root (the simulated failure test below still runs)")
        small = {"w": torch.zeros(8, 1024)}  # 32 KiB
        checkpoint.save(root, 1, small, {"x": 1}, {}, keep_last=5)
        big = {"w": torch.zeros(40, 1024)}  # 160 KiB: cannot fit next to the first
        with pytest.raises(CheckpointError, match="No space left on device"):
            checkpoint.save(root, 2, big, {"x": 1}, {}, keep_last=5)
        assert checkpoint.pointer(root, "latest") == "step-000001"
        assert not (root / "step-000002.tmp").exists()
        assert checkpoint.find_resumable(root).step == 1  # type: ignore[union-attr]


def test_write_failure_midway_keeps_the_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_step(tmp_path, 1)

    def failing_save(obj: object, f: object) -> None:
        Path(str(f)).write_bytes(b"partial")
        raise OSError(28, os.strerror(28))

    monkeypatch.setattr(write.torch, "save", failing_save)
    with pytest.raises(CheckpointError, match=r"No space left on device; the previous checkpoint step-000001 is"):
        checkpoint.save(tmp_path, 2, tiny_state(), {"x": 1}, {}, keep_last=2)
    with pytest.raises(CheckpointError, match=r"No space left on device; no earlier checkpoint was written$"):
        checkpoint.save(tmp_path / "fresh", 1, tiny_state(), {"x": 1}, {}, keep_last=2)  # nothing to fall back on
    assert checkpoint.pointer(tmp_path, "latest") == "step-000001"
    assert not (tmp_path / "step-000002.tmp").exists()
    assert not (tmp_path / "step-000002").exists()


def test_staged_copies_do_not_change_when_training_does_and_ties_stay_tied() -> None:
    model = tiny_state(1)
    exp_avg = torch.zeros(4)
    trainer = {"optimizer": {"state": {0: {"exp_avg": exp_avg}}, "param_groups": [{"lr": 0.1, "params": [0]}]}}
    staged_model, staged_trainer = write.stage(model), write.stage(trainer)
    before = model["embed.weight"].clone()
    model["embed.weight"].add_(1.0)  # the next optimizer steps change the live tensors in place
    exp_avg.add_(1.0)
    trainer["optimizer"]["param_groups"][0]["lr"] = 0.2  # type: ignore[index]
    assert torch.equal(staged_model["embed.weight"], before)
    assert staged_model["embed.weight"] is staged_model["lm_head.weight"]  # saved once, as before
    assert torch.equal(staged_trainer["optimizer"]["state"][0]["exp_avg"], torch.zeros(4))
    assert staged_trainer["optimizer"]["param_groups"][0]["lr"] == 0.1


def test_background_saves_one_at_a_time_with_their_timings(tmp_path: Path) -> None:
    saver = write.BackgroundSaver()
    trainer = {"optimizer": {"state": {}, "param_groups": []}, "rng": [torch.get_rng_state()]}
    for step in (1, 2):  # the second waits for the first: one save in flight
        blocked = saver.save(tmp_path, step, tiny_state(step), trainer, {"tokens": step}, keep_last=5)
        assert blocked >= 0.0
    assert saver.wait() and not saver.in_flight
    done = saver.collect()
    assert [d.checkpoint.path.name for d in done] == ["step-000001", "step-000002"]
    assert all(d.write_seconds >= d.blocked_seconds > 0 for d in done)
    assert checkpoint.pointer(tmp_path, "latest") == "step-000002"
    assert torch.equal(checkpoint.verify(done[1].checkpoint.path).model_state()["embed.weight"],
                       tiny_state(2)["embed.weight"])
    assert saver.collect() == []


def test_a_failed_background_save_is_raised_in_the_caller_and_keeps_the_previous(tmp_path: Path) -> None:
    saver = write.BackgroundSaver()
    trainer: dict[str, object] = {"optimizer": {"state": {}, "param_groups": []}}
    saver.save(tmp_path, 1, tiny_state(1), trainer, {}, keep_last=5)
    saver.wait()
    saver.collect()
    (tmp_path / "step-000002.tmp").write_text("in the way")  # a file where the save needs its folder
    saver.save(tmp_path, 2, tiny_state(2), trainer, {}, keep_last=5)
    saver.wait()
    with pytest.raises(CheckpointError, match=r"save checkpoint step-000002.*previous checkpoint step-000001 is"):
        saver.collect()
    assert checkpoint.pointer(tmp_path, "latest") == "step-000001"
    assert saver.collect() == []  # raised once


def _saver_with_step_1(tmp_path: Path) -> tuple[write.BackgroundSaver, dict[str, object]]:
    """A background saver that has written and recorded step 1 (the checkpoint that must survive)."""
    saver = write.BackgroundSaver()
    trainer: dict[str, object] = {"optimizer": None}
    saver.save(tmp_path, 1, tiny_state(1), trainer, {}, keep_last=5)
    saver.wait()
    saver.collect()
    return saver, trainer


def test_a_background_save_with_shards_finishes_only_once_every_shard_is_written(tmp_path: Path) -> None:
    saver, trainer = _saver_with_step_1(tmp_path)
    folder = checkpoint.begin(tmp_path, 2)
    shards: Future[None] = Future()  # what DCP's async_save hands back: done once every rank wrote its shard
    saver.save(tmp_path, 2, None, trainer, {"shapes": {"w": [2]}}, keep_last=5, shards=shards)
    saver.wait_staged()
    assert not saver.wait(timeout=0.2)  # held by the shards: nothing renamed, `latest` unmoved
    assert checkpoint.pointer(tmp_path, "latest") == "step-000001" and folder.is_dir()
    (folder / "shards").mkdir()
    (folder / "shards" / "__0_0.distcp").write_bytes(b"shard")
    (folder / "shards" / ".metadata").write_bytes(b"index")  # rank 0's, which no writer hashed
    (folder / ".digests").mkdir()  # what each rank's HashingWriter leaves: the digests of the files it wrote
    digest = checkpoint.file_digest(folder / "shards" / "__0_0.distcp")
    (folder / ".digests" / "__0_json").write_text(json.dumps({"shards/__0_0.distcp": digest}))
    shards.set_result(None)
    assert saver.wait()
    [done] = saver.collect()
    assert checkpoint.pointer(tmp_path, "latest") == "step-000002"
    files = checkpoint.verify(done.checkpoint.path).meta["files"]
    assert files["shards/__0_0.distcp"]["xxh3_128"] == digest and "shards/.metadata" in files
    assert "model.safetensors" not in files and not (done.checkpoint.path / ".digests").exists()
    assert done.checkpoint.meta["shapes"] == {"w": [2]}


def test_a_shard_that_failed_fails_the_background_save_and_keeps_the_previous(tmp_path: Path) -> None:
    saver, trainer = _saver_with_step_1(tmp_path)
    checkpoint.begin(tmp_path, 2)
    shards: Future[None] = Future()
    shards.set_exception(OSError(28, "No space left on device"))  # a rank could not write its shard
    saver.save(tmp_path, 2, tiny_state(2), trainer, {}, keep_last=5, shards=shards)
    saver.wait()
    with pytest.raises(CheckpointError, match=r"step-000002.*its shards.*previous checkpoint step-000001 is"):
        saver.collect()
    assert checkpoint.pointer(tmp_path, "latest") == "step-000001"
    assert not (tmp_path / "step-000002.tmp").exists() and not (tmp_path / "step-000002").exists()

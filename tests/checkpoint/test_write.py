"""Checkpoint files: atomic writes, checksums, pointers, pruning, refusal of broken or foreign checkpoints."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from kubetrain import checkpoint
from kubetrain.checkpoint import write
from kubetrain.errors import CheckpointError, IncompatibleCheckpointError


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(16, 8, generator=g)
    return {"embed.weight": emb, "lm_head.weight": emb, "norm.weight": torch.ones(8)}


def _save(root: Path, step: int, keep_last: int = 2, best: bool = False) -> checkpoint.Checkpoint:
    trainer = {"optimizer": {"state": {}, "param_groups": []}, "step": step, "rng": [torch.get_rng_state()]}
    return checkpoint.save(root, step, _state(step), trainer, {"tokens": step * 10}, keep_last=keep_last, is_best=best)


def test_save_writes_files_pointers_and_checksums(tmp_path: Path) -> None:
    ck = _save(tmp_path, 5, best=True)
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
    assert torch.equal(loaded.model_state()["embed.weight"], _state(5)["embed.weight"])
    assert loaded.trainer_state()["step"] == 5
    assert loaded.trainer_state()["rng"][0].equal(torch.get_rng_state())


def test_files_are_standard_safetensors_and_the_trainer_state_round_trips(tmp_path: Path) -> None:
    from safetensors import safe_open

    opt_state = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 3).to(torch.bfloat16)},
                           1: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(0)}},
                 "param_groups": [{"lr": 0.1, "params": [0, 1], "betas": (0.9, 0.95)}]}
    trainer = {"optimizer": opt_state, "loader": {"cursor": 12}, "rng": [torch.get_rng_state()], "flag": None}
    ck = checkpoint.save(tmp_path, 1, _state(), trainer, {}, keep_last=1)
    with safe_open(str(ck.path / "model.safetensors"), framework="pt") as f:  # the library reads our writer's file
        assert sorted(f.keys()) == ["embed.weight", "norm.weight"]
        assert f.get_tensor("embed.weight").equal(_state()["embed.weight"])
    back = checkpoint.verify(ck.path).trainer_state()
    assert back["loader"] == {"cursor": 12} and back["flag"] is None
    assert back["optimizer"]["param_groups"] == opt_state["param_groups"]
    assert back["optimizer"]["state"][0]["exp_avg"].equal(opt_state["state"][0]["exp_avg"])
    assert back["optimizer"]["state"][0]["exp_avg"].dtype == torch.bfloat16
    assert back["optimizer"]["state"][1]["exp_avg"].shape == (0,)


def test_trainer_state_loads_without_pickle_execution(tmp_path: Path) -> None:
    ck = _save(tmp_path, 1)

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, ("true",))

    torch.save({"x": Evil()}, ck.path / "trainer.pt")
    with pytest.raises(Exception, match=r"[Ww]eights only"):
        ck.trainer_state()


def test_keep_last_prunes_but_keeps_best(tmp_path: Path) -> None:
    _save(tmp_path, 1, best=True)
    for step in (2, 3, 4):
        _save(tmp_path, step)
    names = [p.name for p in checkpoint.complete_checkpoints(tmp_path)]
    assert names == ["step-000001", "step-000003", "step-000004"]
    assert checkpoint.pointer(tmp_path, "best") == "step-000001"


def test_corrupt_checkpoint_is_skipped_for_the_previous_one(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    ck2 = _save(tmp_path, 2)
    data = bytearray((ck2.path / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF  # same size, different bytes: only the checksum can tell
    (ck2.path / "model.safetensors").write_bytes(bytes(data))
    warnings: list[str] = []
    found = checkpoint.find_resumable(tmp_path, warn=warnings.append)
    assert found is not None and found.step == 1
    assert any("checksum" in w for w in warnings)


def test_half_written_checkpoints_are_never_loaded(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    ck2 = _save(tmp_path, 2)
    (ck2.path / "trainer.pt").write_bytes(b"truncated")  # a torn file
    half = tmp_path / "step-000003.tmp"  # a save killed before its rename
    shutil.copytree(ck2.path, half)
    no_meta = tmp_path / "step-000004"  # a folder with no meta.json
    no_meta.mkdir()
    found = checkpoint.find_resumable(tmp_path, warn=lambda m: None)
    assert found is not None and found.step == 1


def test_newest_complete_checkpoint_wins_over_a_stale_latest_pointer(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    (tmp_path / "latest").write_text("step-000001\n")  # killed between the rename and the pointer update
    found = checkpoint.find_resumable(tmp_path)
    assert found is not None and found.step == 2


def test_resave_of_same_step_replaces_it(tmp_path: Path) -> None:
    _save(tmp_path, 3)
    again = _save(tmp_path, 3)
    assert checkpoint.verify(again.path).step == 3
    assert [p.name for p in checkpoint.complete_checkpoints(tmp_path)] == ["step-000003"]


def test_incompatible_shapes_and_tokenizer_are_refused(tmp_path: Path) -> None:
    ck = _save(tmp_path, 1)
    shapes = {k: list(v.shape) for k, v in checkpoint.unique_tensors(_state()).items()}
    checkpoint.check_compatible(ck, shapes, None)
    with pytest.raises(IncompatibleCheckpointError, match=r"embed\.weight"):
        checkpoint.check_compatible(ck, {**shapes, "embed.weight": [32, 8]}, None)
    with pytest.raises(IncompatibleCheckpointError, match="weights differ"):
        checkpoint.check_compatible(ck, {**shapes, "extra.weight": [1]}, None)
    ck.meta["tokenizer"] = "byte"
    with pytest.raises(IncompatibleCheckpointError, match="tokenizer"):
        checkpoint.check_compatible(ck, shapes, "bpe:abc")


def test_unwritable_folder_fails_clearly_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    # Root ignores permission bits, so make the folder unwritable by putting a file where the save needs a dir.
    (tmp_path / "step-000002.tmp").write_text("in the way")
    os.chmod(tmp_path, 0o500)
    try:
        with pytest.raises(CheckpointError, match="could not save checkpoint step-000002"):
            checkpoint.save(tmp_path, 2, _state(), {"x": 1}, {}, keep_last=2)
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
    _save(tmp_path, 1)

    def failing_save(obj: object, f: object) -> None:
        Path(str(f)).write_bytes(b"partial")
        raise OSError(28, os.strerror(28))

    monkeypatch.setattr(write.torch, "save", failing_save)
    with pytest.raises(CheckpointError, match=r"No space left"):
        checkpoint.save(tmp_path, 2, _state(), {"x": 1}, {}, keep_last=2)
    assert checkpoint.pointer(tmp_path, "latest") == "step-000001"
    assert not (tmp_path / "step-000002.tmp").exists()
    assert not (tmp_path / "step-000002").exists()

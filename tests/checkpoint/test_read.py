"""checkpoint.read: verification, the newest checkpoint that verifies, refusal of broken or foreign ones."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch

from kubetrain import checkpoint
from kubetrain.checkpoint import verdict
from kubetrain.errors import (
    EXIT_BAD_INPUT,
    CheckpointError,
    IncompatibleCheckpointError,
    NoCheckpointVerifies,
    UserInputError,
)
from kubetrain.models.load import locate
from tests.checkpoint.conftest import age_files, count_hashing, save_step, tiny_state


def test_trainer_state_loads_without_pickle_execution(tmp_path: Path) -> None:
    ck = save_step(tmp_path, 1)

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, ("true",))

    torch.save({"x": Evil()}, ck.path / "trainer.pt")
    with pytest.raises(Exception, match=r"[Ww]eights only"):
        ck.trainer_state()


def test_corrupt_checkpoint_is_skipped_for_the_previous_one(tmp_path: Path) -> None:
    save_step(tmp_path, 1)
    ck2 = save_step(tmp_path, 2)
    data = bytearray((ck2.path / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF  # same size, different bytes: only the checksum can tell
    (ck2.path / "model.safetensors").write_bytes(bytes(data))
    warnings: list[str] = []
    found = checkpoint.find_resumable(tmp_path, warn=warnings.append)
    assert found is not None and found.step == 1
    assert any("checksum" in w for w in warnings)


def test_when_no_checkpoint_verifies_resuming_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    for step in (1, 2):
        ck = save_step(tmp_path, step)
        data = bytearray((ck.path / "model.safetensors").read_bytes())
        data[-1] ^= 0xFF
        (ck.path / "model.safetensors").write_bytes(bytes(data))
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and ".verified" not in p.parts}
    warnings: list[str] = []
    with pytest.raises(NoCheckpointVerifies, match=r"none of the 2 checkpoints in .* verifies: the run would start "
                                                   r"again from step 0") as refused:
        checkpoint.find_resumable(tmp_path, warn=warnings.append)
    assert refused.value.exit_code == EXIT_BAD_INPUT
    assert len(warnings) == 2
    assert {p: p.read_bytes() for p in before} == before
    assert checkpoint.find_resumable(tmp_path / "empty") is None  # no checkpoint at all: a fresh start


def _hostile_trainer_pt(ck: checkpoint.Checkpoint) -> None:
    """trainer.pt replaced by a pickle of an object that runs code, its size and digest updated to match."""

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, ("true",))

    torch.save({"x": Evil()}, ck.path / "trainer.pt")
    meta = json.loads((ck.path / "meta.json").read_text())
    meta["files"]["trainer.pt"] = {checkpoint.CHECKSUM: checkpoint.file_digest(ck.path / "trainer.pt"),
                                   "bytes": (ck.path / "trainer.pt").stat().st_size}
    (ck.path / "meta.json").write_text(json.dumps(meta))


def test_a_trainer_pt_that_weights_only_refuses_is_a_corrupt_checkpoint(tmp_path: Path) -> None:
    save_step(tmp_path, 1)
    _hostile_trainer_pt(save_step(tmp_path, 2))
    warnings: list[str] = []
    found = checkpoint.find_resumable(tmp_path, warn=warnings.append)
    assert found is not None and found.step == 1
    assert len(warnings) == 1 and "step-000002: trainer.pt is not plain data that loads safely" in warnings[0]
    _hostile_trainer_pt(found)
    with pytest.raises(NoCheckpointVerifies):
        checkpoint.find_resumable(tmp_path, warn=lambda m: None)
    with pytest.raises(UserInputError, match=r"does not verify: trainer.pt is not plain data"):
        checkpoint.resolve(found.path)  # --resume PATH


def test_a_corrupt_checkpoint_named_by_the_user_is_bad_input(tmp_path: Path) -> None:
    ck = save_step(tmp_path, 1)
    (ck.path / "model.safetensors").write_bytes(b"x" * (ck.path / "model.safetensors").stat().st_size)
    for named in (checkpoint.resolve, lambda p: locate(p)[1]):  # train --resume PATH; generate/export PATH
        with pytest.raises(UserInputError, match=rf"checkpoint {ck.path} does not verify: model.safetensors fails "
                                                 r"its checksum$") as refused:
            named(ck.path)
        assert refused.value.exit_code == EXIT_BAD_INPUT


def test_half_written_checkpoints_are_never_loaded(tmp_path: Path) -> None:
    save_step(tmp_path, 1)
    ck2 = save_step(tmp_path, 2)
    (ck2.path / "trainer.pt").write_bytes(b"truncated")  # a torn file
    half = tmp_path / "step-000003.tmp"  # a save killed before its rename
    shutil.copytree(ck2.path, half)
    no_meta = tmp_path / "step-000004"  # a folder with no meta.json
    no_meta.mkdir()
    found = checkpoint.find_resumable(tmp_path, warn=lambda m: None)
    assert found is not None and found.step == 1


def test_newest_complete_checkpoint_wins_over_a_stale_latest_pointer(tmp_path: Path) -> None:
    save_step(tmp_path, 1)
    save_step(tmp_path, 2)
    (tmp_path / "latest").write_text("step-000001\n")  # killed between the rename and the pointer update
    found = checkpoint.find_resumable(tmp_path)
    assert found is not None and found.step == 2


def test_incompatible_shapes_and_tokenizer_are_refused(tmp_path: Path) -> None:
    ck = save_step(tmp_path, 1)
    shapes = {k: list(v.shape) for k, v in checkpoint.unique_tensors(tiny_state()).items()}
    checkpoint.check_compatible(ck, shapes, None)
    with pytest.raises(IncompatibleCheckpointError, match=r"embed\.weight"):
        checkpoint.check_compatible(ck, {**shapes, "embed.weight": [32, 8]}, None)
    with pytest.raises(IncompatibleCheckpointError, match="weights differ"):
        checkpoint.check_compatible(ck, {**shapes, "extra.weight": [1]}, None)
    ck.meta["tokenizer"] = "byte"
    with pytest.raises(IncompatibleCheckpointError, match="tokenizer"):
        checkpoint.check_compatible(ck, shapes, "bpe:abc")


def test_a_checkpoint_is_hashed_once_by_concurrent_ranks_and_later_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = save_step(tmp_path, 1)
    age_files(ckpt.path)
    hashed = count_hashing(monkeypatch)
    ranks = [threading.Thread(target=checkpoint.find_resumable, args=(tmp_path,)) for _ in range(4)]
    for rank in ranks:  # each opens the lock on its own: they exclude each other as processes do
        rank.start()
    for rank in ranks:
        rank.join()
    assert sorted(hashed) == sorted(ckpt.meta["files"])  # every file once, not once per rank
    assert checkpoint.find_resumable(tmp_path) is not None and len(hashed) == len(ckpt.meta["files"])
    # a file written again (another mtime) is hashed again, and damage found that way is remembered too
    weights = ckpt.path / checkpoint.MODEL_FILE
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    age_files(ckpt.path)
    hashed.clear()
    for _ in range(2):
        with pytest.raises(CheckpointError, match=r"model\.safetensors fails its checksum"):
            checkpoint.verify(ckpt.path)
    assert len(hashed) == len(ckpt.meta["files"])
    assert verdict.recorded(ckpt.path, ckpt.meta["files"]) == (True, "model.safetensors fails its checksum")


def test_files_too_new_to_trust_their_mtime_get_no_verdict(tmp_path: Path) -> None:
    ckpt = save_step(tmp_path, 1)
    checkpoint.verify(ckpt.path)
    assert not (tmp_path / verdict.VERDICTS / f"{ckpt.path.name}.json").exists()

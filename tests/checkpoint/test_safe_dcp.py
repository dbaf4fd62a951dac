"""checkpoint.safe_dcp: a sharded optimizer checkpoint loads back, and a forged or tampered one cannot run code."""

from __future__ import annotations

import io
import json
import pathlib
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

from kubetrain import checkpoint
from kubetrain.checkpoint.safe_dcp import SafeLoadPlanner, load_metadata
from kubetrain.errors import CheckpointError
from tests.checkpoint.conftest import age_files, count_hashing

# DCP in one process without a process group (what it does here) is what it warns about
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class TouchOnLoad:
    """Unpickling this creates `marker`: code run by a pickle, without os.system."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[Path]]:
        return (pathlib.Path.touch, (self.marker,))


def _model_and_optimizer(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.8, 0.9))


def _sharded_checkpoint(root: Path) -> checkpoint.Checkpoint:
    """A checkpoint with its optimizer written through DCP, as an FSDP run writes it (here in one process)."""
    model, opt = _model_and_optimizer(0)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    checkpoint.save_optimizer(model, opt, checkpoint.begin(root, 1))
    return checkpoint.save(root, 1, model.state_dict(), {"optimizer": None}, {}, keep_last=2, prepared=True)


def _forge(ckpt: checkpoint.Checkpoint, name: str, data: bytes) -> None:
    """Replace a file and rewrite meta.json to match: what an attacker who forges the whole checkpoint does."""
    (ckpt.path / name).write_bytes(data)
    meta = json.loads((ckpt.path / "meta.json").read_text())
    meta["files"][name] = {checkpoint.CHECKSUM: checkpoint.file_digest(ckpt.path / name), "bytes": len(data)}
    (ckpt.path / "meta.json").write_text(json.dumps(meta))


def test_sharded_optimizer_round_trips(tmp_path: Path) -> None:
    ckpt = _sharded_checkpoint(tmp_path)
    assert "optimizer/.metadata" in ckpt.meta["files"]  # the metadata is checksummed like the shards
    saved_model, saved_opt = _model_and_optimizer(0)
    saved_model(torch.ones(2, 4)).sum().backward()
    saved_opt.step()
    model, opt = _model_and_optimizer(0)
    checkpoint.load_optimizer(model, opt, ckpt.path)
    mine, theirs = opt.state_dict(), saved_opt.state_dict()
    assert mine["param_groups"][0]["betas"] == (0.8, 0.9) and mine["param_groups"][0]["lr"] == 0.1
    for i in theirs["state"]:
        assert mine["state"][i]["exp_avg"].equal(theirs["state"][i]["exp_avg"])
        assert mine["state"][i]["exp_avg_sq"].equal(theirs["state"][i]["exp_avg_sq"])


def test_the_optimizer_files_are_not_hashed_again_after_the_resume_verified_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = _sharded_checkpoint(tmp_path)
    age_files(ckpt.path)  # as a later start finds them: old enough for their mtimes to be trusted
    hashed = count_hashing(monkeypatch)
    assert checkpoint.find_resumable(tmp_path) is not None
    assert sorted(hashed) == sorted(Path(f).name for f in ckpt.meta["files"])
    checkpoint.load_optimizer(*_model_and_optimizer(0), ckpt.path)
    assert len(hashed) == len(ckpt.meta["files"])  # once, by the resume: not a second time by the load


def test_forged_metadata_cannot_run_code(tmp_path: Path) -> None:
    ckpt = _sharded_checkpoint(tmp_path / "ckpt")
    # torch's own reader would run it: this is the attack, not a strawman
    unsafe = tmp_path / "unsafe-marker"
    forged = tmp_path / "forged"
    forged.mkdir()
    (forged / ".metadata").write_bytes(pickle.dumps(TouchOnLoad(unsafe)))
    with pytest.raises(AttributeError):
        FileSystemReader(forged).read_metadata()
    assert unsafe.exists()

    marker = tmp_path / "marker"
    _forge(ckpt, "optimizer/.metadata", pickle.dumps(TouchOnLoad(marker)))
    checkpoint.verify(ckpt.path)  # meta.json was forged along with it: the digests alone cannot tell
    model, opt = _model_and_optimizer(0)
    with pytest.raises(CheckpointError, match=r"refusing to load .*pathlib\.Path\.touch is not part of"):
        checkpoint.load_optimizer(model, opt, ckpt.path)
    with pytest.raises(CheckpointError, match="refusing"):
        load_metadata(ckpt.path / "optimizer" / ".metadata")
    assert not marker.exists()


def test_values_load_as_plain_data_only(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    evil = io.BytesIO()
    torch.save({"lr": TouchOnLoad(marker)}, evil)
    evil.seek(0)
    with pytest.raises(pickle.UnpicklingError, match=r"[Ww]eights only"):
        SafeLoadPlanner().load_bytes(None, evil)
    assert not marker.exists()


def test_tampered_missing_or_extra_optimizer_files_are_refused_before_loading(tmp_path: Path) -> None:
    ckpt = _sharded_checkpoint(tmp_path)
    model, opt = _model_and_optimizer(0)
    shard = next((ckpt.path / "optimizer").glob("*.distcp"))
    original = shard.read_bytes()
    data = bytearray(original)
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="fails its checksum"):
        checkpoint.load_optimizer(model, opt, ckpt.path)
    shard.write_bytes(original)
    (ckpt.path / "optimizer" / "__1_0.distcp").write_bytes(b"not listed")
    with pytest.raises(CheckpointError, match=r"does not match meta\.json \(optimizer/__1_0\.distcp\)"):
        checkpoint.load_optimizer(model, opt, ckpt.path)
    (ckpt.path / "optimizer" / "__1_0.distcp").unlink()
    (ckpt.path / "optimizer" / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"optimizer/\.metadata"):
        checkpoint.load_optimizer(model, opt, ckpt.path)

"""checkpoint.safe_dcp and checkpoint.sharded in one process: FSDP shards (and the earlier format, the optimizer alone
beside model.safetensors) load back, the whole model is assembled from them, and a forged or tampered checkpoint
cannot run code."""

from __future__ import annotations

import io
import json
import pathlib
import pickle
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as td
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from kubetrain import checkpoint
from kubetrain.checkpoint import sharded
from kubetrain.checkpoint.safe_dcp import SafeLoadPlanner, load_metadata
from kubetrain.checkpoint.sharded import (
    ShardSaver,
    load_model_shards,
    load_optimizer_shards,
    pinned_staging,
    save_shards,
)
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


def _trained(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    model, opt = _model_and_optimizer(seed)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return model, opt


def _sharded_checkpoint(root: Path) -> checkpoint.Checkpoint:
    """A checkpoint whose model and optimizer are DCP shards, as an FSDP run writes it (here in one process)."""
    model, opt = _trained()
    save_shards(model, opt, checkpoint.begin(root, 1))
    shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
    return checkpoint.save(root, 1, None, {"optimizer": None}, {"shapes": shapes}, keep_last=2, prepared=True)


def _earlier_checkpoint(root: Path) -> checkpoint.Checkpoint:
    """An FSDP checkpoint as earlier versions wrote it: the weights whole, the optimizer alone through DCP."""
    model, opt = _trained()
    folder = checkpoint.begin(root, 1)
    dcp.save({"optimizer": get_optimizer_state_dict(model, opt)}, checkpoint_id=str(folder / checkpoint.OPTIMIZER_DIR))
    return checkpoint.save(root, 1, model.state_dict(), {"optimizer": None}, {}, keep_last=2, prepared=True)


def _assert_same_optimizer(opt: torch.optim.Optimizer, saved: torch.optim.Optimizer) -> None:
    mine, theirs = opt.state_dict(), saved.state_dict()
    assert mine["param_groups"][0]["betas"] == (0.8, 0.9) and mine["param_groups"][0]["lr"] == 0.1
    for i in theirs["state"]:
        assert mine["state"][i]["exp_avg"].equal(theirs["state"][i]["exp_avg"])
        assert mine["state"][i]["exp_avg_sq"].equal(theirs["state"][i]["exp_avg_sq"])


def _forge(ckpt: checkpoint.Checkpoint, name: str, data: bytes) -> None:
    """Replace a file and rewrite meta.json to match: what an attacker who forges the whole checkpoint does."""
    (ckpt.path / name).write_bytes(data)
    meta = json.loads((ckpt.path / "meta.json").read_text())
    meta["files"][name] = {checkpoint.CHECKSUM: checkpoint.file_digest(ckpt.path / name), "bytes": len(data)}
    (ckpt.path / "meta.json").write_text(json.dumps(meta))


def test_shards_round_trip_and_assemble_into_the_whole_model(tmp_path: Path) -> None:
    ckpt = _sharded_checkpoint(tmp_path)
    # the one writer hashed its shard file; .metadata was hashed by whoever finished the checkpoint
    assert {"shards/.metadata", "shards/__0_0.distcp"} <= set(ckpt.meta["files"])
    assert not (ckpt.path / "model.safetensors").exists() and not (ckpt.path / ".digests").exists()
    saved_model, saved_opt = _trained()
    model, opt = _model_and_optimizer(1)  # other weights: the load must replace them
    load_model_shards(model, ckpt.path)
    load_optimizer_shards(model, opt, ckpt.path)
    _assert_same_optimizer(opt, saved_opt)
    whole = ckpt.model_state()  # what export and generate read: assembled from the shards
    assert whole.keys() == saved_model.state_dict().keys()
    assert all(whole[k].equal(v) and model.state_dict()[k].equal(v) for k, v in saved_model.state_dict().items())


def test_a_checkpoint_of_the_earlier_format_still_loads(tmp_path: Path) -> None:
    ckpt = _earlier_checkpoint(tmp_path)
    saved_model, saved_opt = _trained()
    model, opt = _model_and_optimizer(1)
    checkpoint.sharded.load_optimizer(model, opt, ckpt.path)
    _assert_same_optimizer(opt, saved_opt)
    assert all(ckpt.model_state()[k].equal(v) for k, v in saved_model.state_dict().items())


def test_background_saves_stage_into_reused_pinned_buffers_on_cuda_only() -> None:
    assert pinned_staging("cuda") and not pinned_staging("cpu") and not pinned_staging("mps")
    saver = ShardSaver(None, torch.device("cpu"))  # type: ignore[arg-type]  # a CPU run: fresh buffers per save
    assert saver.stager is None
    state = {"w": torch.ones(3), "nested": {"step": torch.tensor(2.0), "lr": 0.1}, "groups": [{"params": ["w"]}]}
    buffers = sharded.host_buffers(state)
    assert not buffers["w"].is_pinned() and buffers["w"].data_ptr() != state["w"].data_ptr()
    copied = sharded.copy_state(state, buffers)
    assert copied["w"].equal(state["w"]) and copied["nested"]["step"].equal(state["nested"]["step"])
    assert copied["nested"]["lr"] == 0.1 and copied["groups"] == [{"params": ["w"]}]
    state["w"].add_(1)  # the copy is the state when it was copied
    assert copied["w"].equal(torch.ones(3))


def test_a_background_save_copies_in_its_thread_and_writes_what_was_copied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop gets `staged` back at once; the copy is made in the saver's thread; what is written is the state
    when it was copied, even though the optimizer steps before the write finishes."""
    copied_in: list[str] = []
    copy_state = sharded.copy_state
    monkeypatch.setattr(sharded, "copy_state",
                        lambda *a: copied_in.append(threading.current_thread().name) or copy_state(*a))
    td.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        model, opt = _trained()
        saver = ShardSaver(td.new_group(backend="gloo"), torch.device("cpu"))
        before = {k: v.clone() for k, v in model.state_dict().items()}
        folder = checkpoint.begin(tmp_path / "checkpoints", 1)
        inflight = saver.save(model, opt, folder)
        inflight.staged.result()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()  # what the loop does once staged: the weights change while (or before) the thread writes
        inflight.written.result()
    finally:
        td.destroy_process_group()
    assert copied_in and all(name.startswith("kubetrain-shards") for name in copied_in)  # none in the loop
    shapes = {k: list(v.shape) for k, v in before.items()}
    ckpt = checkpoint.save(tmp_path / "checkpoints", 1, None, {"optimizer": None}, {"shapes": shapes}, keep_last=2,
                           prepared=True)
    assert {"shards/.metadata", "shards/__0_0.distcp"} <= set(ckpt.meta["files"])  # hashed by the writer
    whole = ckpt.model_state()
    assert all(whole[k].equal(v) for k, v in before.items())
    assert not all(whole[k].equal(v) for k, v in model.state_dict().items())


def test_the_optimizer_files_are_not_hashed_again_after_the_resume_verified_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = _sharded_checkpoint(tmp_path)
    age_files(ckpt.path)  # as a later start finds them: old enough for their mtimes to be trusted
    hashed = count_hashing(monkeypatch)
    assert checkpoint.find_resumable(tmp_path) is not None
    assert sorted(hashed) == sorted(Path(f).name for f in ckpt.meta["files"])
    load_optimizer_shards(*_model_and_optimizer(0), ckpt.path)
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
    _forge(ckpt, "shards/.metadata", pickle.dumps(TouchOnLoad(marker)))
    checkpoint.verify(ckpt.path)  # meta.json was forged along with it: the digests alone cannot tell
    model, opt = _model_and_optimizer(0)
    with pytest.raises(CheckpointError, match=r"refusing to load .*pathlib\.Path\.touch is not part of"):
        load_optimizer_shards(model, opt, ckpt.path)
    with pytest.raises(CheckpointError, match="refusing"):
        load_metadata(ckpt.path / "shards" / ".metadata")
    assert not marker.exists()


def test_values_load_as_plain_data_only(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    evil = io.BytesIO()
    torch.save({"lr": TouchOnLoad(marker)}, evil)
    evil.seek(0)
    with pytest.raises(pickle.UnpicklingError, match=r"[Ww]eights only"):
        SafeLoadPlanner().load_bytes(None, evil)
    assert not marker.exists()


def test_tampered_missing_or_extra_shard_files_are_refused_before_loading(tmp_path: Path) -> None:
    ckpt = _sharded_checkpoint(tmp_path)
    model, opt = _model_and_optimizer(0)
    shard = next((ckpt.path / "shards").glob("*.distcp"))
    original = shard.read_bytes()
    data = bytearray(original)
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="fails its checksum"):
        load_optimizer_shards(model, opt, ckpt.path)
    shard.write_bytes(original)
    (ckpt.path / "shards" / "__1_0.distcp").write_bytes(b"not listed")
    with pytest.raises(CheckpointError, match=r"does not match meta\.json \(shards/__1_0\.distcp\)"):
        load_optimizer_shards(model, opt, ckpt.path)
    (ckpt.path / "shards" / "__1_0.distcp").unlink()
    (ckpt.path / "shards" / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"shards/\.metadata"):
        load_optimizer_shards(model, opt, ckpt.path)

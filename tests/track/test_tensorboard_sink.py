"""TensorBoard: the event files a real run writes, read back with TensorBoard's own EventAccumulator."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from kubetrain.config import load_config
from kubetrain.runs.reader import read_metrics
from kubetrain.track.tensorboard_sink import TensorboardSink

from .conftest import TrainTiny


def events(folder: Path) -> EventAccumulator:
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return acc


@pytest.mark.slow
def test_training_writes_scalars_and_config(train_tiny: TrainTiny) -> None:
    result = train_tiny("track.tensorboard.enabled=true")
    run_dir = Path(result.run_dir)
    acc = events(run_dir / "tensorboard")
    records = read_metrics(run_dir / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == \
        [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in train]
    assert [(e.step, e.value) for e in acc.Scalars("eval/val_loss")] == \
        [(r["step"], pytest.approx(r["val_loss"], rel=1e-6)) for r in evals]
    scalars = set(acc.Tags()["scalars"])
    assert {"train/lr", "train/tokens_per_second", "train/memory_gib", "eval/val_ppl"} <= scalars
    config_text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "n_embd: 32" in config_text


def test_shared_root_gets_a_folder_per_run_and_phase(tmp_path: Path) -> None:
    sink = TensorboardSink(tmp_path / "tb", stream=io.StringIO())
    sink.start({"run": "big", "phase": "code", "run_dir": str(tmp_path / "big"), "start_step": 0,
                "config": load_config(None, None, [])})
    sink.log({"kind": "train", "step": 3, "loss": 1.25, "lr": 0.1, "tokens": 30, "mfu": None})
    sink.finish("finished")
    acc = events(tmp_path / "tb" / "big" / "code")
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(3, 1.25)]
    assert "train/mfu" not in acc.Tags()["scalars"]

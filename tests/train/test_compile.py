"""torch.compile from outside: blocks compiled in place keep their names and numerics; reset drops the graphs.

The "eager" backend runs the real Dynamo capture without Inductor's C++/Triton code generation (slow here).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.utils import counters

from kubetrain.config import load_config
from kubetrain.distributed.parallelize import compile_blocks
from kubetrain.models import build_model
from kubetrain.models.gpt import Block
from kubetrain.runs.reader import read_metrics
from kubetrain.train.compile import reset_compiled
from kubetrain.train.trainer import train


def test_blocks_compile_in_place_and_reset_drops_their_graphs() -> None:
    cfg = load_config(overrides=["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.block_size=16"])
    torch.manual_seed(0)
    model = build_model(cfg.model, 256)
    names = list(model.state_dict())
    ids = torch.randint(0, 256, (2, 16))
    eager = model(ids)
    reset_compiled()
    assert compile_blocks(model, backend="eager") == 2
    assert list(model.state_dict()) == names  # no `_orig_mod.`: checkpoints keep their keys
    assert torch.equal(model(ids), eager)
    assert _debug_get_cache_entry_list(Block.forward.__code__)  # the graph is there...
    reset_compiled()
    assert not _debug_get_cache_entry_list(Block.forward.__code__)  # ... and gone after a reset
    assert compile_blocks(torch.nn.Linear(2, 2)) == 0  # nothing to compile per block


def _train(tmp_path: Path, data_cache: Path, name: str, *overrides: str) -> list[float]:
    sets = ["run.threads=1", "model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.block_size=16",
            "train.micro_batch_size=2", "train.max_steps=2", "train.warmup_steps=1", "train.log_every_steps=1",
            "eval.batches=1", "eval.sample_prompt=null", f"run.name={name}", f"run.output_dir={tmp_path}",
            f"data.cache_dir={data_cache}", *overrides]
    result = train(load_config(None, None, sets), argv=[], log=lambda _: None)
    assert result.status == "finished" and result.steps == 2
    return [r["loss"] for r in read_metrics(tmp_path / name / "metrics.jsonl") if r["kind"] == "train"]


@pytest.mark.slow
def test_train_compile_runs_compiled_training_steps_through_the_trainer(tmp_path: Path) -> None:
    # Inductor on the CPU: real C++ code generation and compilation (the machine's C compiler), forward and backward
    reset_compiled()
    counters.clear()
    compiled = _train(tmp_path, tmp_path / "cache", "compiled", "train.compile=true")
    assert counters["inductor"]["fxgraph_cache_miss"] + counters["inductor"]["fxgraph_cache_hit"] >= 2  # fwd + bwd
    assert counters["stats"]["unique_graphs"] >= 1
    eager = _train(tmp_path, tmp_path / "cache", "eager")
    assert compiled == pytest.approx(eager, rel=1e-4)  # the same training, up to Inductor's fused arithmetic
    reset_compiled()

"""torch.compile from outside: blocks compiled in place keep their names and numerics; reset drops the graphs; under
FSDP the blocks and the loss compile as two graphs with the eager numbers.

The "eager" backend runs the real Dynamo capture without Inductor's C++/Triton code generation (slow here).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.utils import counters

from kubetrain.config import load_config
from kubetrain.data.loader import IGNORE_INDEX
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
            "eval.windows=1", "eval.sample_prompt=null", f"run.name={name}", f"run.output_dir={tmp_path}",
            f"data.cache_dir={data_cache}", *overrides]
    result = train(load_config(None, None, sets), argv=[], log=lambda _: None)
    assert result.status == "finished" and result.steps == 2
    return [r["loss"] for r in read_metrics(tmp_path / name / "metrics.jsonl") if r["kind"] == "train"]


@pytest.mark.slow
@pytest.mark.ci  # a heavy end-to-end proof (many processes): .ci/run runs it, not the README's test command
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


def _fsdp_worker(rank: int, world: int, root: str) -> None:
    import datetime
    import json

    import torch.distributed as td
    from torch.distributed.device_mesh import init_device_mesh

    from kubetrain.distributed.parallelize import compile_blocks, precision_plan, shard
    from kubetrain.distributed.setup import teardown
    from kubetrain.models.gpt import GPT, GPTConfig
    from kubetrain.torch_compat import dynamo_counts
    from kubetrain.train.loss import loss_step
    from tests.train.test_loss import GraphCounter, graph_ops

    torch.set_num_threads(1)
    td.init_process_group("gloo", init_method=f"file://{root}/rendezvous", rank=rank, world_size=world,
                          timeout=datetime.timedelta(seconds=120))
    found: dict[str, object] = {}
    for compiled in (False, True):
        counter = GraphCounter()
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
        if compiled:  # parallelize's order: blocks compiled in place, then sharded per block and at the root
            assert compile_blocks(model, backend=counter) == 2  # type: ignore[arg-type]
        shard(model, init_device_mesh("cpu", (world,)), precision_plan("fp32", sharded=True))
        torch.manual_seed(rank)
        ids, labels = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
        labels[0, : rank + 1] = IGNORE_INDEX
        with dynamo_counts() as counts:
            loss = loss_step(model, compiled, blocks_compiled=True, backend=counter)(ids, labels)
            loss.backward()
        name = "compiled" if compiled else "eager"
        found[name] = {"loss": float(loss), "grads": [p.grad.full_tensor().tolist() for p in model.parameters()],
                       "graphs": counts.graphs, "breaks": list(counts.breaks),
                       "ops": [sorted(graph_ops([gm])) for gm in counter.graphs]}
    (Path(root) / f"fsdp-{rank}.json").write_text(json.dumps(found))
    teardown()


@pytest.mark.slow
def test_fsdp_compiles_each_block_in_place_and_the_loss_alone_with_eagers_numbers(tmp_path: Path) -> None:
    import json

    import torch.multiprocessing as mp

    mp.start_processes(_fsdp_worker, args=(2, str(tmp_path)), nprocs=2, start_method="spawn")
    for rank in range(2):
        found = json.loads((tmp_path / f"fsdp-{rank}.json").read_text())
        compiled, eager = found["compiled"], found["eager"]
        # two graphs and no break: the blocks' (both blocks run the one graph, FSDP's all-gathers outside it)...
        assert compiled["graphs"] == 2 and not compiled["breaks"]
        blocks, loss = compiled["ops"]
        assert "scaled_dot_product_attention" in blocks and "cross_entropy" not in blocks
        assert "cross_entropy" in loss and "scaled_dot_product_attention" not in loss  # ... and the loss's
        assert eager["graphs"] == 0  # eager: nothing compiled (the head and loss fused, chunk by chunk)
        assert compiled["loss"] == pytest.approx(eager["loss"], rel=1e-5)
        for mine, theirs in zip(compiled["grads"], eager["grads"], strict=True):
            assert torch.allclose(torch.tensor(mine), torch.tensor(theirs), rtol=1e-4, atol=1e-6)

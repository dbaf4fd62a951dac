"""The training step's forward and loss: one compiled graph of the model and its loss, under DDP too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kubetrain.data.loader import IGNORE_INDEX
from kubetrain.models.loss import lm_loss_sum
from kubetrain.train.loss import loss_step


def test_loss_step_is_the_summed_loss_of_the_models_logits() -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(37, 8), torch.nn.Linear(8, 37))
    ids = torch.randint(0, 37, (2, 5))
    labels = torch.randint(0, 37, (2, 5))
    step = loss_step(model, compiled=False)
    assert torch.equal(step(ids, labels), lm_loss_sum(model(ids), labels))


def test_compiled_loss_step_is_one_graph_of_model_and_loss() -> None:
    # the "eager" backend runs Dynamo's real capture without Inductor's code generation (slow on the CPU)
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Embedding(37, 8), torch.nn.Linear(8, 37))
    ids, labels = torch.randint(0, 37, (2, 5)), torch.randint(0, 37, (2, 5))
    labels[0, 0] = IGNORE_INDEX
    counter = CompileCounter()
    compiled = torch.compile(loss_step(model, compiled=False), backend=counter)
    assert torch.allclose(compiled(ids, labels), loss_step(model, compiled=False)(ids, labels), rtol=1e-6)
    assert counter.frame_count == 1  # no graph break between the model and its loss
    torch._dynamo.reset()


def _ddp_worker(rank: int, world: int, root: str) -> None:
    import datetime
    import json

    import torch.distributed as td
    from torch._dynamo.utils import counters
    from torch.nn.parallel import DistributedDataParallel

    from kubetrain.distributed.setup import teardown
    from kubetrain.models.gpt import GPT, GPTConfig
    from kubetrain.models.loss import counted_tokens

    torch.set_num_threads(1)
    td.init_process_group("gloo", init_method=f"file://{root}/rendezvous", rank=rank, world_size=world,
                          timeout=datetime.timedelta(seconds=120))
    grads = []
    for compiled in (False, True):
        torch.manual_seed(0)
        # the compiled step meets DDP inside: Dynamo compiles the wrapped model with its DDP optimizer
        model = DistributedDataParallel(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)))
        torch.manual_seed(rank)  # each rank its own batch, uneven prompts
        ids, labels = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
        labels[0, : rank + 1] = IGNORE_INDEX
        step = loss_step(model, compiled, backend="aot_eager")
        (step(ids, labels) / counted_tokens(labels)).backward()
        grads.append([p.grad.tolist() for p in model.parameters()])
    (Path(root) / f"grads-{rank}.json").write_text(json.dumps({"eager": grads[0], "compiled": grads[1],
                                                                 "graphs": counters["stats"]["unique_graphs"]}))
    teardown()


@pytest.mark.slow
def test_ddp_compiled_step_all_reduces_the_same_gradients_as_eager_at_3_ranks(tmp_path: Path) -> None:
    import json

    import torch.multiprocessing as mp

    mp.start_processes(_ddp_worker, args=(3, str(tmp_path)), nprocs=3, start_method="spawn")
    found = [json.loads((tmp_path / f"grads-{rank}.json").read_text()) for rank in range(3)]
    for rank_found in found:
        assert rank_found["graphs"] >= 1
        for eager, compiled in zip(rank_found["eager"], rank_found["compiled"], strict=True):
            assert torch.allclose(torch.tensor(compiled), torch.tensor(eager), rtol=1e-4, atol=1e-6)
    assert found[0]["compiled"] == found[2]["compiled"]  # all-reduced: every rank holds the same gradients

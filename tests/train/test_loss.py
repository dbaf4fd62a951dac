"""The training step's forward and loss: eager, the head and loss fused (GPT, Hugging Face + LoRA) with the loss and
gradients of the plain head; compiled, one graph of the model and its loss, under DDP too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kubetrain.data.loader import IGNORE_INDEX
from kubetrain.models.loss import lm_loss_sum
from kubetrain.torch_compat import dynamo_counts
from kubetrain.train.loss import loss_step, takes_labels


def _tiny_gpt(vocab: int = 512) -> torch.nn.Module:
    from kubetrain.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=vocab, block_size=64, n_layer=2, n_head=2, n_embd=32))


def _tiny_gpt_lora() -> torch.nn.Module:
    """Our GPT under PEFT's LoRA (a PeftModel that hands the labels on to the GPT)."""
    from kubetrain.config.schema import LoraConfig
    from kubetrain.models.lora import apply_lora

    model = apply_lora(_tiny_gpt(), LoraConfig(r=4, alpha=8))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # B starts at zero: give the adapters something to differentiate through
            torch.nn.init.normal_(p, std=0.1)
    return model


def _tiny_llama_lora(vocab: int = 512, targets: str | list[str] = "all-linear") -> torch.nn.Module:
    """A 2-layer Llama built from its config (nothing downloaded) with LoRA (all-linear: every linear but the head)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kubetrain.config.schema import LoraConfig
    from kubetrain.models.hf import HFCausalLM
    from kubetrain.models.lora import apply_lora

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      initializer_range=0.2)
    model = apply_lora(HFCausalLM(LlamaForCausalLM(cfg), 64), LoraConfig(r=4, alpha=8, target_modules=targets))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # B starts at zero: give the adapters something to differentiate through
            torch.nn.init.normal_(p, std=0.1)
    return model


def _batch(vocab: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    ids, labels = torch.randint(0, vocab, (2, 64)), torch.randint(0, vocab, (2, 64))
    labels[0, :20] = IGNORE_INDEX  # a prompt
    return ids, labels


def _loss_and_grads(model: torch.nn.Module, fn: object) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    ids, labels = _batch()
    loss = fn(ids, labels)  # type: ignore[operator]
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("build", [_tiny_gpt, _tiny_gpt_lora, _tiny_llama_lora],
                         ids=["gpt", "gpt-lora", "hf-llama-lora"])
def test_the_eager_step_fuses_the_head_with_the_plain_heads_loss_and_gradients(build: object) -> None:
    model = build()  # type: ignore[operator]
    assert takes_labels(model)
    fused, fused_grads = _loss_and_grads(model, loss_step(model, compiled=False))
    plain, plain_grads = _loss_and_grads(model, lambda ids, labels: lm_loss_sum(model(ids), labels))
    assert torch.allclose(fused, plain, rtol=1e-5, atol=0)
    assert fused_grads.keys() == plain_grads.keys() and fused_grads
    for name, grad in fused_grads.items():
        assert torch.allclose(grad, plain_grads[name], rtol=1e-5, atol=1e-6), name


@pytest.mark.parametrize("build", [_tiny_gpt, _tiny_llama_lora], ids=["gpt", "hf-llama-lora"])
def test_the_eager_step_keeps_no_tokens_by_vocab_tensor_for_backward(build: object) -> None:
    model = build()  # type: ignore[operator]
    ids, labels = _batch()
    logits_elements = labels.numel() * 512  # 128 tokens x 512: more than any weight (512 x 32)
    saved: list[torch.Tensor] = []

    def biggest(fn: object) -> int:
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            fn(ids, labels)  # type: ignore[operator]
        return max(t.numel() for t in saved)

    assert biggest(lambda i, y: lm_loss_sum(model(i), y)) >= logits_elements  # the plain head keeps its logits
    assert biggest(loss_step(model, compiled=False)) < logits_elements


def test_a_head_with_adapters_on_it_gets_the_whole_logits_and_the_same_loss() -> None:
    head = _tiny_llama_lora(targets=["q_proj", "lm_head"])
    ids, labels = _batch()
    assert torch.allclose(loss_step(head, compiled=False)(ids, labels), lm_loss_sum(head(ids), labels), rtol=1e-6)


def test_loss_step_is_the_summed_loss_of_the_models_logits() -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(37, 8), torch.nn.Linear(8, 37))
    ids = torch.randint(0, 37, (2, 5))
    labels = torch.randint(0, 37, (2, 5))
    step = loss_step(model, compiled=False)
    assert torch.equal(step(ids, labels), lm_loss_sum(model(ids), labels))


class GraphCounter:
    """A Dynamo backend that keeps each graph it is given and runs it as captured (no code generation: Inductor's C++
    takes minutes on a CPU)."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: object) -> object:
        self.graphs.append(gm)
        return gm.forward


def graph_ops(graphs: list[torch.fx.GraphModule]) -> set[str]:
    """The names of the operations the graphs call (functions, methods and modules alike)."""
    return {getattr(n.target, "__name__", str(n.target)) for gm in graphs for n in gm.graph.nodes
            if n.op in ("call_function", "call_method", "call_module")}


def test_the_compiled_step_of_our_gpt_is_one_graph_of_model_and_loss() -> None:
    from kubetrain.train.compile import reset_compiled

    reset_compiled()
    model, counter = _tiny_gpt(), GraphCounter()
    eager, eager_grads = _loss_and_grads(model, loss_step(model, compiled=False))
    with dynamo_counts() as counts:  # the production path: loss_step(compiled=True) compiles and runs it
        compiled, compiled_grads = _loss_and_grads(model, loss_step(model, compiled=True, backend=counter))
    assert counts.graphs == 1 and not counts.breaks and len(counter.graphs) == 1  # one graph, no break
    assert {"embedding", "cross_entropy"} <= graph_ops(counter.graphs)  # from the tokens to the loss
    assert torch.allclose(compiled, eager, rtol=1e-5)
    for name, grad in eager_grads.items():
        assert torch.allclose(compiled_grads[name], grad, rtol=1e-4, atol=1e-6), name
    reset_compiled()


def _ddp_worker(rank: int, world: int, root: str) -> None:
    import datetime
    import json

    import torch.distributed as td
    from torch.nn.parallel import DistributedDataParallel

    from kubetrain.data.loader import counted_tokens
    from kubetrain.distributed.setup import teardown
    from kubetrain.models.gpt import GPT, GPTConfig

    torch.set_num_threads(1)
    td.init_process_group("gloo", init_method=f"file://{root}/rendezvous", rank=rank, world_size=world,
                          timeout=datetime.timedelta(seconds=120))
    grads, counter = [], GraphCounter()
    for compiled in (False, True):
        torch.manual_seed(0)
        # n_embd 128: 1.7 MB of parameters, more than DDP's first bucket (1 MiB), so its buckets are two
        model = DistributedDataParallel(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2,
                                                      n_embd=128)))
        torch.manual_seed(rank)  # each rank its own batch, uneven prompts
        ids, labels = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
        labels[0, : rank + 1] = IGNORE_INDEX
        step = loss_step(model, compiled, backend=counter)
        with dynamo_counts() as counts:
            (step(ids, labels) / counted_tokens(labels)).backward()
        grads.append([p.grad.tolist() for p in model.parameters()])
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    (Path(root) / f"grads-{rank}.json").write_text(json.dumps({
        "eager": grads[0], "compiled": grads[1], "graphs": counts.graphs, "breaks": list(counts.breaks),
        "pieces": len(counter.graphs), "ops": sorted(graph_ops(counter.graphs)),
        "first_graph_inputs": [n.name for n in counter.graphs[0].graph.nodes if n.op == "placeholder"],
        "param_bytes": param_bytes, "bucket_cap": model.bucket_bytes_cap}))
    teardown()


@pytest.mark.slow
@pytest.mark.ci  # a heavy end-to-end proof (many processes): .ci/run runs it, not the README's test command
def test_ddp_compiled_step_is_the_models_graph_split_at_the_buckets_with_eagers_gradients(tmp_path: Path) -> None:
    import json

    import torch.multiprocessing as mp

    mp.start_processes(_ddp_worker, args=(3, str(tmp_path)), nprocs=3, start_method="spawn")
    found = [json.loads((tmp_path / f"grads-{rank}.json").read_text()) for rank in range(3)]
    for rank_found in found:
        # Dynamo does not trace DistributedDataParallel.forward (torch skips it on purpose): the step breaks there,
        # and the wrapped GPT's forward, which takes the labels and so holds the head and the loss, is one graph...
        assert rank_found["graphs"] == 1 and rank_found["breaks"]
        assert any("DistributedDataParallel" in reason for reason in rank_found["breaks"])
        assert any("input_ids" in name for name in rank_found["first_graph_inputs"])
        assert {"embedding", "cross_entropy"} <= set(rank_found["ops"])
        # ... which Dynamo's DDP optimizer splits at DDP's gradient buckets: the first holds 1 MiB, the rest fit one
        assert 2**20 < rank_found["param_bytes"] <= 2**20 + rank_found["bucket_cap"]
        assert rank_found["pieces"] == 2
        for eager, compiled in zip(rank_found["eager"], rank_found["compiled"], strict=True):
            assert torch.allclose(torch.tensor(compiled), torch.tensor(eager), rtol=1e-4, atol=1e-6)
    assert found[0]["compiled"] == found[2]["compiled"]  # all-reduced: every rank holds the same gradients


@pytest.mark.slow
@pytest.mark.ci  # minutes on one thread: run by .ci/run, not the README's test command
@pytest.mark.timeout(3600)  # two steps of a 128k-vocabulary head on one thread of a shared machine: minutes
def test_a_llama_3_2_1b_shaped_lora_step_peaks_at_least_1_5_gib_lower_with_the_same_loss() -> None:
    # The target, measured as bench/bench_head_loss.py does (each variant in a fresh process, one after the
    # other): vocabulary 128,256, hidden 2048, LoRA r16, 1 x 2048 tokens; one layer (the drop is the head's, which
    # the layers do not change: 1.77 GiB with one here). Minutes: the head alone is three 2048 x 2048 x 128,256
    # matmuls per variant on one thread.
    import json
    import subprocess
    import sys

    bench = Path(__file__).resolve().parents[2] / "bench" / "bench_head_loss.py"
    out = subprocess.run([sys.executable, str(bench), "--layers", "1"], capture_output=True, text=True, check=True,
                         timeout=3600)
    found = json.loads(out.stdout)
    assert found["drop_bytes"] >= 1.5 * 2**30, (found["before"], found["fused"])
    assert found["loss_rel_diff"] <= 1e-5


def test_a_model_that_changes_its_logits_after_the_head_gets_them_whole_and_the_same_loss() -> None:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from kubetrain.models.hf import HFCausalLM

    torch.manual_seed(0)  # Gemma 2 soft-caps its logits (tanh) after the head: the fused head would skip that
    cfg = Gemma2Config(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, max_position_embeddings=64, final_logit_softcapping=2.0,
                       initializer_range=0.5)  # logits far past the cap: skipping it would double this loss
    model = HFCausalLM(Gemma2ForCausalLM(cfg), 64)
    ids, labels = _batch()
    assert torch.allclose(loss_step(model, compiled=False)(ids, labels), lm_loss_sum(model(ids), labels), rtol=1e-6)

"""FSDP built on the meta device: sharded, materialised, then initialised or loaded shard by shard, it holds the very
weights one process builds (gathered and compared bitwise on this machine), at 2 and 3 gloo ranks."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from kubetrain.config.schema import ModelConfig
from kubetrain.distributed import parallelize
from kubetrain.models import build_model, fill_weights
from kubetrain.models.gpt import GPT, GPTConfig
from tests.hf_models import build_llama

GPT_SHAPE = GPTConfig(vocab_size=320, block_size=16, n_layer=3, n_head=2, n_embd=40)  # rows not divisible by 3


def _sharded_builds(rank: int, world: int, store: str, out: str, models: dict[str, dict[str, Any]]) -> None:
    """One rank: build each model with meta parameters, checkpoint activations, shard (bf16 compute), materialise,
    fill; rank 0 saves the gathered weights, the shards' dtype and row counts, and the RNG state left behind."""
    import torch.distributed as td
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    td.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        results = {}
        for key, model_cfg in models.items():
            cfg = ModelConfig(**model_cfg)
            torch.manual_seed(1234)
            with parallelize.params_on_meta():
                model = build_model(cfg, 300, load_weights=False)
            parallelize.checkpoint_blocks(model)
            parallelize.shard(model, "bf16")
            parallelize.materialise(model, torch.device("cpu"))
            fill_weights(model, cfg, parallelize.keep_part)
            rng = torch.get_rng_state()
            rows = [p.to_local().shape[0] for p in model.parameters() if isinstance(p, DTensor)]
            model(torch.arange(12).view(2, 6)).float().sum().backward()  # the sharded model trains
            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            results[key] = {"state": full, "rng": rng, "rows": rows,
                            "dtypes": sorted({str(p.dtype) for p in model.parameters()})}
        results["accumulation"] = _sharded_gradients_between_micro_batches(rank, world, Path(out).parent)
        if rank == 0:
            torch.save(results, out)
    finally:
        td.destroy_process_group()


def _sharded_gradients_between_micro_batches(rank: int, world: int, root: Path) -> bool:
    """One Trainer step of 2 micro-batches under FSDP (bf16 compute): when the second starts, does every weight
    hold a sharded gradient already (reduce-scattered), rather than FSDP keeping the unsharded ones?"""
    from torch.distributed.tensor import DTensor

    from kubetrain.config.loading import validate
    from kubetrain.train.trainer import RunOptions, Trainer

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    cfg = validate({"run": {"name": "accum", "output_dir": str(root / "runs"), "threads": 1},
                    "data": {"cache_dir": str(root / "cache")},
                    "model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16},
                    "train": {"max_steps": 1, "micro_batch_size": 2, "grad_accum_steps": 2, "precision": "bf16"},
                    "dist": {"strategy": "fsdp"}, "track": {"console": False}})
    trainer = Trainer(cfg, RunOptions(argv=[]), log=lambda m: None)
    trainer.setup()
    trainer.open()
    seen: list[bool] = []

    def before_forward(module: torch.nn.Module, args: Any) -> None:
        seen.append(all(isinstance(p.grad, DTensor) for p in module.parameters()))

    trainer.model.register_forward_pre_hook(before_forward, prepend=True)  # before FSDP gathers the root
    trainer.train_step()
    return seen == [False, True]  # before the first micro-batch no gradient exists yet


GPT_CFG = {"n_layer": GPT_SHAPE.n_layer, "n_head": GPT_SHAPE.n_head, "n_embd": GPT_SHAPE.n_embd,
           "block_size": GPT_SHAPE.block_size, "vocab_size": GPT_SHAPE.vocab_size}


@pytest.mark.slow
def test_sharded_builds_hold_the_single_process_weights(tmp_path: Path) -> None:
    """3 ranks (weights of 320 and 40 rows: uneven shards): our GPT's init, a tiny Llama loaded in bf16, and a
    Trainer step accumulating 2 micro-batches under FSDP."""
    import torch.multiprocessing as mp
    from transformers import AutoModelForCausalLM

    llama = build_llama(tmp_path / "llama", vocab=320, seed=3)
    models = {"gpt": GPT_CFG,
              "hf": {"kind": "hf", "name_or_path": str(llama), "block_size": 32, "dtype": "bfloat16"}}
    out = tmp_path / "gathered.pt"
    mp.spawn(_sharded_builds, args=(3, str(tmp_path / "store"), str(out), models), nprocs=3)
    got = torch.load(out, weights_only=True)

    torch.manual_seed(1234)
    single = GPT(GPT_SHAPE)
    expected = single.state_dict()
    assert set(got["gpt"]["state"]) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(got["gpt"]["state"][name], tensor), name
    assert torch.equal(got["gpt"]["rng"], torch.get_rng_state())  # dropout and sampling go on from the same stream
    assert got["gpt"]["dtypes"] == ["torch.float32"]  # bf16 compute, fp32 weights: the MixedPrecisionPolicy
    assert sum(got["gpt"]["rows"]) < sum(p.shape[0] for p in single.parameters())  # rank 0 holds a part

    assert got["accumulation"]  # gradient accumulation keeps only sharded gradients between micro-batches

    hf = AutoModelForCausalLM.from_pretrained(str(llama), dtype=torch.bfloat16).state_dict()
    assert got["hf"]["dtypes"] == ["torch.bfloat16"]  # loaded in the configured dtype, no fp32 copy
    for name, tensor in hf.items():
        assert torch.equal(got["hf"]["state"]["lm." + name], tensor), name


def test_params_on_meta_keeps_buffers_and_draws_nothing() -> None:
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with parallelize.params_on_meta():
        model = GPT(GPT_SHAPE)
    assert torch.equal(torch.get_rng_state(), before)
    assert all(p.is_meta for p in model.parameters())
    assert not model.rope_cos.is_meta and torch.equal(model.rope_cos, GPT(GPT_SHAPE).rope_cos)


def test_one_process_init_through_keep_part_equals_the_plain_build() -> None:
    """Without sharding, the meta build filled by init_weights is GPT(cfg) itself (world size 1)."""
    torch.manual_seed(5)
    with parallelize.params_on_meta():
        model = GPT(GPT_SHAPE)
    parallelize.materialise(model, torch.device("cpu"))
    model.init_weights(parallelize.keep_part)
    torch.manual_seed(5)
    reference = GPT(GPT_SHAPE)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values(),
                                                 strict=True))


def test_checkpointed_blocks_give_the_same_loss_and_gradients() -> None:
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    results = []
    for checkpointed in (False, True):
        torch.manual_seed(3)
        model = GPT(cfg)
        if checkpointed:
            assert parallelize.checkpoint_blocks(model) == 2
        saved: list[int] = []

        def pack(t: torch.Tensor, saved: list[int] = saved) -> torch.Tensor:
            saved.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = torch.nn.functional.cross_entropy(model(ids).view(-1, 64), ids.view(-1))
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()},
                        list(model.state_dict()), sum(saved)))
    (loss_a, grads_a, names_a, kept_a), (loss_b, grads_b, names_b, kept_b) = results
    assert kept_b < kept_a / 2  # the blocks' activations were not kept for backward
    assert torch.equal(loss_a, loss_b)
    assert names_a == names_b  # hooks, not wrappers: checkpoints keep their names
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, rtol=0, atol=1e-6)

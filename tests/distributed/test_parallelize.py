"""Parallelism from outside, at 4 gloo ranks: FSDP and HSDP (2 x 2) built on the meta device, each rank drawing only
its shards (the same weights at every layout, for one seed), a tiny Llama with LoRA loaded shard by shard in bf16,
bf16 training with FSDP's policy and no autocast; and the pieces that need no process group."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from kubetrain.config.loading import validate
from kubetrain.distributed import parallelize
from kubetrain.distributed.env import ProcessEnv
from kubetrain.errors import ConfigError
from kubetrain.models import fill_weights
from kubetrain.models.gpt import GPT, GPTConfig
from kubetrain.train.model_for_world import build_model_for_world
from tests.hf_models import build_llama

SEED = 1234
GPT_CFG = {"n_layer": 3, "n_head": 2, "n_embd": 40, "block_size": 16, "vocab_size": 320}  # rows not divisible by 3
SMALL_CHUNK = 64  # elements: several chunks per weight, so each rank's share of the init work shows


def _config(root: Path, strategy: str, model: dict[str, Any], **train: Any) -> Any:
    return validate({"run": {"name": strategy, "output_dir": str(root / "runs"), "threads": 1, "seed": SEED},
                     "data": {"cache_dir": str(root / "cache")}, "model": model,
                     "train": {"max_steps": 1, "micro_batch_size": 2, **train},
                     "dist": {"strategy": strategy}, "track": {"console": False}})


def _gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _builds(rank: int, world: int, store: str, out: str, llama: str) -> None:
    """One of 4 ranks (2 per "node"): our GPT under FSDP and HSDP, a LoRA Llama under FSDP, a bf16 Trainer step."""
    import torch.distributed as td
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    td.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    root = Path(out).parent
    penv = ProcessEnv(rank=rank, world_size=world, local_rank=rank % 2, local_world_size=2)
    cpu = torch.device("cpu")
    try:
        results: dict[str, Any] = {}
        for strategy in ("fsdp", "hsdp"):
            cfg = _config(root, strategy, {k: v for k, v in GPT_CFG.items()})
            rng = torch.get_rng_state()
            model = build_model_for_world(cfg, 300, cpu, "bf16", penv)
            untouched = torch.equal(rng, torch.get_rng_state())
            state = _gathered(model)
            init = parallelize.ShardInit(SEED)
            init.CHUNK = SMALL_CHUNK
            fill_weights(model, cfg.model, init)  # drawn again in smaller chunks, counted
            local = sum(p.to_local().numel() for p in model.parameters() if p.dim() >= 2)  # type: ignore[attr-defined]
            placements = {str(p.placements) for p in model.parameters() if isinstance(p, DTensor)}
            model(torch.arange(12).view(2, 6)).float().sum().backward()  # the sharded model trains
            drawn = [None] * world
            td.all_gather_object(drawn, (init.drawn, local, untouched))
            results[strategy] = {"state": state, "drawn": drawn, "placements": placements,
                                 "dtypes": sorted({str(p.dtype) for p in model.parameters()})}

        lora = {"kind": "hf", "name_or_path": llama, "block_size": 32,
                "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}}
        model = build_model_for_world(_config(root, "fsdp", lora), 300, cpu, "bf16", penv)
        frozen = {str(p.dtype) for p in model.parameters() if not p.requires_grad}
        adapters = {str(p.dtype) for p in model.parameters() if p.requires_grad}
        results["lora"] = {"state": _gathered(model), "frozen": frozen, "adapters": adapters,
                           "meta_free": not any(p.is_meta for p in model.parameters())}
        results["step"] = _bf16_fsdp_step(rank, world, root)
        if rank == 0:
            torch.save(results, out)
    finally:
        td.destroy_process_group()


def _bf16_fsdp_step(rank: int, world: int, root: Path) -> dict[str, Any]:
    """One Trainer step of 2 micro-batches under FSDP in bf16: what a projection sees in its forward (autocast off,
    weights gathered in bf16 by the policy), and whether every gradient is a shard when the second micro-batch
    starts (reduce-scattered, not kept unsharded)."""
    from torch.distributed.tensor import DTensor

    from kubetrain.train.state import optimizer_steps
    from kubetrain.train.trainer import RunOptions, Trainer

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2")
    cfg = _config(root, "fsdp", {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16},
                  grad_accum_steps=2, precision="bf16")
    trainer = Trainer(cfg, RunOptions(argv=[]), log=lambda m: None)
    trainer.setup()
    trainer.open()
    seen: dict[str, list[Any]] = {"sharded_grads": [], "autocast": [], "weight": []}

    def before_forward(module: torch.nn.Module, args: Any) -> None:
        seen["sharded_grads"].append(all(isinstance(p.grad, DTensor) for p in module.parameters()))

    def in_projection(module: torch.nn.Module, args: Any) -> None:
        seen["autocast"].append(torch.is_autocast_enabled("cpu"))
        seen["weight"].append(str(module.weight.dtype))  # type: ignore[union-attr]

    trainer.model.register_forward_pre_hook(before_forward, prepend=True)  # before FSDP gathers the root
    trainer.model.blocks[0].attn.q_proj.register_forward_pre_hook(in_projection)  # type: ignore[index,union-attr]
    trainer.train_step()

    # fp16: gathered in fp16 by the policy, the GradScaler skipping a step whose gradients overflowed
    cfg = _config(root, "fsdp", {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16}, precision="fp16")
    trainer = Trainer(cfg, RunOptions(argv=[]), log=lambda m: None)
    trainer.setup()
    trainer.open()
    trainer.model.blocks[0].attn.q_proj.register_forward_pre_hook(in_projection)  # type: ignore[index,union-attr]
    overflow = trainer.model.blocks[0].register_forward_hook(  # type: ignore[index,union-attr]
        lambda module, args, out: out * float("inf") if rank == 1 else out)  # one rank's gradients overflow
    scale = trainer.scaler.get_scale()
    trainer.train_step()
    overflow.remove()
    trainer.logged_loss.sums.zero_()
    seen["fp16_skipped"] = [optimizer_steps(trainer.optimizer), trainer.scaler.get_scale() / scale]
    trainer.train_step()
    seen["fp16_stepped"] = [optimizer_steps(trainer.optimizer), bool(torch.isfinite(trainer.logged_loss.sums).all())]
    return seen


@pytest.mark.ci  # 4 processes (25 s); the one-process tests below build the same plan (CI's stage)
@pytest.mark.slow
def test_sharded_builds_at_four_ranks(tmp_path: Path) -> None:
    import torch.multiprocessing as mp
    from safetensors.torch import load_file

    llama = build_llama(tmp_path / "llama", vocab=320, seed=3)
    out = tmp_path / "gathered.pt"
    mp.spawn(_builds, args=(4, str(tmp_path / "store"), str(out), str(llama)), nprocs=4)
    got = torch.load(out, weights_only=True)

    # The model one process trains with the same config and seed: what every layout holds, gathered.
    whole = build_model_for_world(_config(tmp_path, "ddp", GPT_CFG), 300, torch.device("cpu"), "fp32", ProcessEnv())
    expected = whole.state_dict()
    for strategy in ("fsdp", "hsdp"):
        state = got[strategy]["state"]
        assert set(state) == set(expected), strategy
        assert all(torch.equal(state[k], v) for k, v in expected.items()), strategy
        assert got[strategy]["dtypes"] == ["torch.float32"]  # bf16 compute, fp32 weights: FSDP's policy
        total = sum(p.numel() for p in whole.parameters() if p.dim() >= 2)
        for drawn, local, untouched in got[strategy]["drawn"]:
            assert untouched  # the global RNG (dropout) is left where the seed put it
            # each rank draws its shard plus at most two chunks (here: rows of <= 128) per weight, not the model
            assert local <= drawn <= local + 2 * 128 * 22, (strategy, drawn, local)
            assert drawn < total / (3.5 if strategy == "fsdp" else 1.75)
        assert sum(local for _, local, _ in got[strategy]["drawn"]) == total * (1 if strategy == "fsdp" else 2)
    assert got["fsdp"]["placements"] == {"(Shard(dim=0),)"}
    assert got["hsdp"]["placements"] == {"(Replicate(), Shard(dim=0))"}  # replicated over 2 nodes, sharded in 2

    lora = got["lora"]
    assert lora["frozen"] == {"torch.bfloat16"} and lora["adapters"] == {"torch.float32"} and lora["meta_free"]
    files = load_file(llama / "model.safetensors")
    for name, tensor in files.items():
        base = name.replace("self_attn.q_proj.", "self_attn.q_proj.base_layer.")
        base = base.replace("self_attn.v_proj.", "self_attn.v_proj.base_layer.")
        base = base.replace("mlp.down_proj.", "mlp.down_proj.base_layer.")
        assert torch.equal(lora["state"]["lm.base_model.model." + base], tensor.to(torch.bfloat16)), name
    b = [v for k, v in lora["state"].items() if ".lora_B." in k]
    a = [v for k, v in lora["state"].items() if ".lora_A." in k]
    assert len(a) == len(b) == 6 and all(not t.any() for t in b)  # the adapted model starts as its base
    assert all(0 < t.abs().max() <= 1 / math.sqrt(t.shape[1]) for t in a)  # PEFT's kaiming-uniform bound
    lora_cfg = {"kind": "hf", "name_or_path": str(llama), "block_size": 32,
                "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}}
    alone = build_model_for_world(_config(tmp_path, "ddp", lora_cfg), 300, torch.device("cpu"), "bf16", ProcessEnv())
    adapters = {k: v for k, v in alone.state_dict().items() if ".lora_" in k}
    assert len(adapters) == 12 and all(torch.equal(lora["state"][k], v) for k, v in adapters.items())  # one process's

    step = got["step"]
    assert step["autocast"] == [False] * 4  # FSDP's policy computes in bf16 / fp16; no autocast on top of it
    assert step["weight"] == ["torch.bfloat16"] * 2 + ["torch.float16"] * 2
    assert step["fp16_skipped"] == [0, 0.5]  # the overflow on one rank: no step anywhere, the scale halved
    assert step["fp16_stepped"] == [1, True]
    assert step["sharded_grads"] == [False, True]  # gradient accumulation keeps only sharded gradients


def _runs(rank: int, world: int, store: str, root_name: str, llama: str, chat: str) -> None:
    """One of 4 ranks (2 per "node"): FSDP and HSDP runs resuming each other's checkpoints, FSDP and DDP from the
    same weights, and LoRA's first loss under FSDP and DDP."""
    import torch.distributed as td

    from kubetrain.train.trainer import train
    from tests.hf_models import lora_config

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2")
    td.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    root = Path(root_name)
    gpt = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16}

    def run(name: str, strategy: str, steps: int, **options: Any) -> None:
        cfg = _config(root, strategy, gpt, log_every_steps=1, max_steps=steps)
        cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": name}),
                                     "checkpoint": cfg.checkpoint.model_copy(update={"async_save": False})})
        train(cfg, log=lambda m: None, argv=[], **options)

    try:
        run("ref", "fsdp", 4)
        run("hsdp-then-fsdp", "hsdp", 2)
        run("hsdp-then-fsdp", "fsdp", 4)
        run("fsdp-then-hsdp", "fsdp", 2)
        run("fsdp-then-hsdp", "hsdp", 4)
        start = root / "runs" / "ref" / "checkpoints" / "step-000004"
        for strategy in ("fsdp", "ddp"):  # the same weights, a fresh optimizer: the same two steps
            run(f"{strategy}-from-ref", strategy, 2, resume="never", init_weights=start)
        for strategy in ("ddp", "fsdp"):  # adapters start at zero (B): the first loss is the base's
            cfg = lora_config(root / strategy, Path(llama), Path(chat), train__max_steps=1)
            train(cfg.model_copy(update={"dist": cfg.dist.model_copy(update={"strategy": strategy})}),
                  log=lambda m: None, argv=[])
    finally:
        td.destroy_process_group()


@pytest.mark.ci  # four 2-to-4-process Llama runs (50 s); test_sharded resumes sharded checkpoints (CI's stage)
@pytest.mark.slow
def test_hsdp_and_fsdp_resume_each_other_and_train_as_ddp(llama_dir: Path, chat_file: Path, tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    from tests.launch.test_elastic import _train_losses as losses

    mp.spawn(_runs, args=(4, str(tmp_path / "store"), str(tmp_path), str(llama_dir), str(chat_file)), nprocs=4)
    runs = tmp_path / "runs"
    ref = losses(runs / "ref")
    assert len(ref) == 4
    for name in ("hsdp-then-fsdp", "fsdp-then-hsdp"):  # each resumed at step 2 from the other's checkpoint
        assert losses(runs / name) == pytest.approx(ref, rel=1e-5), name
        assert (runs / name / "checkpoints" / "step-000004").is_dir()
    assert losses(runs / "ddp-from-ref") == pytest.approx(losses(runs / "fsdp-from-ref"), rel=1e-5)
    lora = [losses(tmp_path / strategy / "lora")[0] for strategy in ("ddp", "fsdp")]
    assert lora[1] == pytest.approx(lora[0], rel=1e-5)


def test_hsdp_mesh_is_nodes_by_local_processes_and_refuses_a_size_that_does_not_divide() -> None:
    assert parallelize.mesh_shape("fsdp", 8, 4, None) == (8,)
    assert parallelize.mesh_shape("hsdp", 8, 4, None) == (2, 4)  # shard within the node, replicate across
    assert parallelize.mesh_shape("hsdp", 8, 4, 2) == (4, 2)
    assert parallelize.mesh_shape("hsdp", 4, 4, None) == (1, 4)
    with pytest.raises(ConfigError, match=r"^hsdp: dist.shard_size 3 must divide the world size 8; .*\[1, 2, 4, 8\]"):
        parallelize.mesh_shape("hsdp", 8, 4, 3)
    with pytest.raises(ConfigError, match="the 3 processes per node"):
        parallelize.mesh_shape("hsdp", 4, 3, None)


def test_shard_init_is_one_init_per_seed_with_the_asked_scale() -> None:
    def draw(seed: int) -> tuple[torch.Tensor, int]:
        init = parallelize.ShardInit(seed)
        init.CHUNK = 50
        weight = torch.empty(37, 10)
        init("w", weight, "normal", 0.5)
        return weight, init.drawn

    whole, drawn = draw(7)
    assert drawn == 37 * 10  # chunks of 5 rows: nothing drawn twice
    assert torch.equal(whole, draw(7)[0])
    other, _ = draw(8)
    assert not torch.equal(whole, other)
    assert 0.4 < float(whole.std()) < 0.6
    bounded = torch.empty(6, 100)
    parallelize.ShardInit(7)("u", bounded, "uniform", 0.1)
    assert 0.09 < float(bounded.abs().max()) <= 0.1


def test_params_on_meta_keeps_buffers_and_draws_nothing() -> None:
    shape = GPTConfig(**GPT_CFG)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with parallelize.params_on_meta():
        model = GPT(shape)
    assert torch.equal(torch.get_rng_state(), before)
    assert all(p.is_meta for p in model.parameters())
    assert not model.rope_cos.is_meta and torch.equal(model.rope_cos, GPT(shape).rope_cos)


def test_one_process_parallelize_checkpoints_blocks_and_compiles_nothing_unasked() -> None:
    from torch.distributed._composable import checkpoint

    cfg = validate({"model": {"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 16,
                              "gradient_checkpointing": True}})
    model = build_model_for_world(cfg, 64, torch.device("cpu"), "fp32", ProcessEnv())
    assert isinstance(model, GPT)  # one process: no wrapper
    assert all(checkpoint.state(b) is not None for b in model.blocks)


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

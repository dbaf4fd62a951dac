"""The model as each world trains it: one seed gives one initial model on one process, under DDP, FSDP and HSDP
(the weights gathered, and the loss of the first step); LoRA added, parallelism applied once.

The sharded builds at 4 ranks (FSDP, HSDP 2 x 2, a LoRA Llama loaded shard by shard) are in
tests/distributed/test_parallelize.py."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from kubetrain.config.loading import validate
from kubetrain.distributed.env import ProcessEnv
from kubetrain.distributed.parallelize import ShardInit
from kubetrain.models import build_model
from kubetrain.models.lora import is_lora
from kubetrain.train.model_for_world import build_model_for_world

MODEL = {"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 16}
SEED = 77
GPT = {"n_layer": 2, "n_head": 2, "n_embd": 24, "block_size": 16}  # 24 columns: rows of the head split unevenly
LORA = {"r": 2, "target_modules": ["q_proj", "down_proj"]}


def _config(root: Path, strategy: str, model: dict[str, Any], **dist: Any) -> Any:
    """One step of a global batch of 4 sequences: 2 x 2 accumulated on one process, 2 per rank on two."""
    return validate({"run": {"name": strategy, "output_dir": str(root / "runs"), "threads": 1, "seed": SEED},
                     "data": {"cache_dir": str(root / "cache")}, "model": model,
                     "train": {"max_steps": 1, "micro_batch_size": 2, "global_batch_size": 4, "log_every_steps": 1},
                     "dist": {"strategy": strategy, **dist}, "track": {"console": False}})


def _gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights by their plain names (DDP's `module.` and FSDP's shards undone)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {name: tensor.clone() for name, tensor in whole.items()}  # unsharded, they are the weights themselves


def _first_step(cfg: Any) -> tuple[dict[str, torch.Tensor], float]:
    """The Trainer's initial weights (gathered) and the loss of its first step."""
    from kubetrain.train.launch_plan import plan_worker
    from kubetrain.train.trainer import RunOptions, Trainer

    cfg = plan_worker(cfg).cfg  # the accumulation that keeps the global batch at this world size, as `train` does
    trainer = Trainer(cfg, RunOptions(argv=[], resume="never"), log=lambda m: None)
    trainer.setup()
    trainer.open()
    weights = _gathered(trainer.model)
    trainer.train_step()
    return weights, trainer.logged_loss.read_and_reset()


def _ranks(rank: int, world: int, store: str, root: str) -> None:
    import torch.distributed as td

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    td.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        got: dict[str, Any] = {}
        # HSDP with a shard group of 1: replicated over the 2 ranks, each drawing its (whole) part itself
        for name, strategy, dist in (("ddp", "ddp", {}), ("fsdp", "fsdp", {}), ("hsdp", "hsdp", {"shard_size": 1})):
            got[name] = _first_step(_config(Path(root), strategy, GPT, **dist))
        penv = ProcessEnv(rank=rank, world_size=world, local_rank=rank, local_world_size=world)
        lora = _config(Path(root), "fsdp", {**GPT, "lora": LORA})
        got["fsdp-lora"] = _gathered(build_model_for_world(lora, 256, torch.device("cpu"), "fp32", penv))
        if rank == 0:
            torch.save(got, Path(root) / "ranks.pt")
    finally:
        td.destroy_process_group()


@pytest.mark.slow  # 2 processes, 3 strategies (about 30 s here)
def test_one_seed_gives_one_initial_model_and_first_loss_under_every_strategy(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_ranks, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    got = torch.load(tmp_path / "ranks.pt", weights_only=True)
    weights, loss = _first_step(_config(tmp_path, "ddp", GPT))  # one process: no launcher, the same config
    for strategy in ("ddp", "fsdp", "hsdp"):
        theirs, their_loss = got[strategy]
        assert theirs.keys() == weights.keys(), strategy
        for name, tensor in weights.items():
            assert torch.equal(theirs[name], tensor), (strategy, name)
        assert their_loss == pytest.approx(loss, abs=1e-6), strategy  # the same model, the same global batch
    alone = _gathered(build_model_for_world(_config(tmp_path, "fsdp", {**GPT, "lora": LORA}), 256,
                                            torch.device("cpu"), "fp32", ProcessEnv()))
    assert got["fsdp-lora"].keys() == alone.keys()
    assert all(torch.equal(got["fsdp-lora"][k], v) for k, v in alone.items())  # base and adapters alike


def test_one_process_build_is_shard_init_s_weights_with_the_weights_names() -> None:
    cfg = validate({"run": {"seed": SEED}, "model": {**MODEL, "gradient_checkpointing": True}})
    rng = torch.get_rng_state()
    model = build_model_for_world(cfg, 64, torch.device("cpu"), "fp32", ProcessEnv())
    assert torch.equal(rng, torch.get_rng_state())  # drawn by name, not from the global RNG (dropout's)
    plain = build_model(validate({"model": MODEL}).model, 64)
    assert list(model.state_dict()) == list(plain.state_dict())  # hooks, not wrappers
    init = ShardInit(SEED)
    for name, tensor in model.named_parameters():  # a tied head once, under the embedding's name
        expected = torch.empty_like(tensor)
        if tensor.dim() < 2:
            init(name, expected, "constant", 1.0)
        else:
            init(name, expected, "normal", plain.init_std(name))  # type: ignore[operator]
        assert torch.equal(tensor, expected), name
    assert model.lm_head.weight is model.embed.weight  # type: ignore[union-attr]  # tied again after meta


def test_lora_is_added_before_parallelism() -> None:
    cfg = validate({"model": {**MODEL, "lora": {"r": 2, "target_modules": ["q_proj"]}}})
    model = build_model_for_world(cfg, 64, torch.device("cpu"), "fp32", ProcessEnv())
    assert is_lora(model)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        f"base_model.model.blocks.{i}.attn.q_proj.lora_{ab}.default.weight" for i in range(2) for ab in "AB"}

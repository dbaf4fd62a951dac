"""FSDP2 on 4 gloo ranks: every rank writes and hashes its DCP shards of the model and optimizer, nothing gathers the
model to save it, the resume is exact (also into 2 ranks), and export and generate assemble the whole model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from kubetrain import checkpoint
from tests.conftest import cli_env
from tests.launch.test_elastic import _train_losses as _losses
from tests.train.conftest import kubetrain, sets

pytestmark = pytest.mark.slow

COMMON = ("train.max_steps=6", "checkpoint.every_steps=2", "checkpoint.keep_last=3", "eval.every_steps=2",
          "dist.strategy=fsdp", "eval.sample_prompt=null")

# Loaded by every Python process of the run (PYTHONPATH): records each request for a whole (gathered) model.
WATCH = '''
import os
import torch.distributed.checkpoint.state_dict as sd
from torch.distributed.tensor import DTensor

def _record(what):
    with open(os.environ["KT_GATHERS"], "a") as f:
        f.write(what + "\\n")

_get, _full = sd.get_model_state_dict, DTensor.full_tensor

def get_model_state_dict(model, *args, options=None, **kwargs):
    if options is not None and options.full_state_dict:
        _record("get_model_state_dict(full_state_dict=True)")
    return _get(model, *args, options=options, **kwargs)

def full_tensor(self, *args, **kwargs):
    if self.dim() > 0:  # a gathered weight (a 0-d norm is no model)
        _record("DTensor.full_tensor " + str(tuple(self.shape)))
    return _full(self, *args, **kwargs)

sd.get_model_state_dict, DTensor.full_tensor = get_model_state_dict, full_tensor
'''


def _rewind(run: Path, to: Path, step: int) -> None:
    """A copy of `run` as it was just after the checkpoint of `step`: the later ones gone, `latest` on it."""
    shutil.copytree(run, to)
    for later in checkpoint.complete_checkpoints(to / "checkpoints"):
        if checkpoint.verify(later).step > step:
            shutil.rmtree(later)
    (to / "checkpoints" / "latest").write_text(checkpoint.step_name(step) + "\n")
    (to / "checkpoints" / "best").write_text(checkpoint.step_name(step) + "\n")


@pytest.mark.ci  # a heavy end-to-end proof (many processes): .ci/run runs it, not the README's test command
def test_shards_written_by_every_rank_resume_exactly_and_export(tmp_path: Path) -> None:
    cache = f"data.cache_dir={tmp_path}/c"
    watch = tmp_path / "watch"
    watch.mkdir()
    (watch / "sitecustomize.py").write_text(WATCH)
    env = cli_env(KT_GATHERS=str(tmp_path / "gathers"))
    env["PYTHONPATH"] = os.pathsep.join([str(watch), env["PYTHONPATH"]])
    train = [sys.executable, "-m", "kubetrain", "train", *sets("run.name=ref", cache, *COMMON), "--nproc", "4",
             "--oversubscribe"]
    done = subprocess.run(train, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "gathers").exists(), (tmp_path / "gathers").read_text()  # no whole model, not even once
    probe = ("import torch; from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict;"
             " get_model_state_dict(torch.nn.Linear(2, 2), options=StateDictOptions(full_state_dict=True))")
    subprocess.run([sys.executable, "-c", probe], env=env, check=True)
    assert "full_state_dict=True" in (tmp_path / "gathers").read_text()  # the watch was live in those processes

    ref = tmp_path / "runs" / "ref"
    for step in (2, 4, 6):  # periodic (in the background) and final (synchronous) saves alike
        ckpt = checkpoint.verify(ref / "checkpoints" / checkpoint.step_name(step))  # every digest holds
        shards = sorted(p.name for p in (ckpt.path / "shards").iterdir())
        assert shards == [".metadata", *(f"__{rank}_0.distcp" for rank in range(4))]  # each rank wrote its own
        assert {f"shards/{name}" for name in shards} <= set(ckpt.meta["files"])
        assert not (ckpt.path / "model.safetensors").exists() and not (ckpt.path / ".digests").exists()
    whole = ckpt.model_state()  # assembled from the 4 ranks' shards
    assert ckpt.meta["shapes"] == {k: list(v.shape) for k, v in whole.items() if k != "lm_head.weight"}  # whole

    # killed after the checkpoint of step 4, resumed at 4 ranks: the same run, bit for bit
    _rewind(ref, tmp_path / "runs" / "cut", 4)
    kubetrain("train", *sets("run.name=cut", cache, *COMMON), "--nproc", "4", "--oversubscribe", cwd=tmp_path)
    assert _losses(tmp_path / "runs" / "cut") == _losses(ref)
    final = checkpoint.step_name(6)
    mine = checkpoint.verify(tmp_path / "runs" / "cut" / "checkpoints" / final).model_state()
    theirs = checkpoint.verify(ref / "checkpoints" / final).model_state()
    assert mine.keys() == theirs.keys() and all(mine[k].equal(theirs[k]) for k in theirs)

    # resumed at 2 ranks (DCP reshards model and optimizer), the same tokens per step: the same curve
    _rewind(ref, tmp_path / "runs" / "two", 4)
    kubetrain("train", *sets("run.name=two", cache, *COMMON, "train.grad_accum_steps=2"), "--nproc", "2",
              cwd=tmp_path)
    assert _losses(tmp_path / "runs" / "two") == pytest.approx(_losses(ref), rel=1e-4, abs=1e-5)
    # FSDP and DDP from the same weights train alike: tests/distributed/test_parallelize.py; they start from the
    # same weights: tests/train/test_model_for_world.py

    # export and generate assemble the whole model from the shards, in one process
    kubetrain("export", str(ref), "--format", "hf", "-o", str(tmp_path / "hf"), cwd=tmp_path)
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    best = checkpoint.verify(ref / "checkpoints" / (ref / "checkpoints" / "best").read_text().strip()).model_state()
    assert exported["model.embed_tokens.weight"].equal(best["embed.weight"])
    assert exported["model.layers.1.mlp.down_proj.weight"].equal(best["blocks.1.mlp.down_proj.weight"])
    out = kubetrain("generate", str(ref), "--prompt", "the", "--max-new-tokens", "4", cwd=tmp_path)
    assert out.stdout.startswith("the")
    assert json.loads((ref / "meta.json").read_text())["status"] == "finished"


def _whole_optimizer_worker(rank: int, world: int, root: Path) -> None:
    """One process trains 2 steps and keeps its optimizer's state_dict (as a DDP checkpoint holds it) and weights;
    FSDP on `world` ranks resumes from both and takes the third step: the same weights as the one process's."""
    import torch
    import torch.distributed as td
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from kubetrain.checkpoint.sharded import load_whole_optimizer
    from kubetrain.config.schema import TrainConfig
    from kubetrain.train.optim import build_optimizer

    torch.set_num_threads(1)
    td.init_process_group("gloo", init_method=f"file://{root}/rendezvous", rank=rank, world_size=world)
    cfg, cpu = TrainConfig(weight_decay=0.1), torch.device("cpu")
    batch = torch.arange(48, dtype=torch.float32).reshape(6, 8) / 48

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 5))

    def step(m: nn.Module, opt: torch.optim.Optimizer) -> None:
        m(batch).square().mean().backward()
        opt.step()
        opt.zero_grad()

    one = model()
    opt = build_optimizer(one, cfg, cpu)
    step(one, opt)
    step(one, opt)
    saved = {"state": {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()},
             "param_groups": opt.state_dict()["param_groups"]}
    weights = {k: v.clone() for k, v in one.state_dict().items()}
    step(one, opt)

    sharded = model()
    sharded.load_state_dict(weights)
    for layer in sharded:
        fully_shard(layer)
    fully_shard(sharded)
    sharded_opt = build_optimizer(sharded, cfg, cpu)
    load_whole_optimizer(sharded, sharded_opt, saved)
    step(sharded, sharded_opt)
    expected = one.state_dict()
    diff = max(float((p.full_tensor() - expected[n]).abs().max()) for n, p in sharded.named_parameters())
    steps = {int(s["step"]) for s in sharded_opt.state.values()}
    (root / f"result-{rank}.json").write_text(json.dumps({"diff": diff, "steps": sorted(steps)}))
    td.barrier()
    td.destroy_process_group()


def test_a_whole_model_checkpoints_optimizer_resumes_under_fsdp(tmp_path: Path) -> None:
    """A checkpoint of one process or DDP (the optimizer whole, by parameter index) resumed under FSDP at 3 ranks
    (uneven shards): each rank keeps its part, and the next step is the one process's."""
    import torch.multiprocessing as mp

    mp.spawn(_whole_optimizer_worker, args=(3, tmp_path), nprocs=3, join=True)
    for rank in range(3):
        result = json.loads((tmp_path / f"result-{rank}.json").read_text())
        assert result["steps"] == [3] and result["diff"] < 1e-6, result

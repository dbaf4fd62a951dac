"""FSDP2 on CPU/gloo: sharded optimizer checkpoints through torch.distributed.checkpoint that resume exactly."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.launch.test_elastic import _train_losses as _losses
from tests.launch.test_elastic import _workers
from tests.train.conftest import kubetrain, sets, start, wait_until

pytestmark = pytest.mark.slow

COMMON = ("train.max_steps=12", "checkpoint.every_steps=4", "checkpoint.keep_last=3", "eval.every_steps=4",
          "model.n_embd=64", "train.log_every_steps=2")


def test_fsdp_checkpoints_resume_exactly(tmp_path: Path) -> None:
    cache = f"data.cache_dir={tmp_path}/c"
    kubetrain("train", *sets("run.name=ref", "dist.strategy=fsdp", cache, *COMMON), "--nproc", "2", cwd=tmp_path)
    ref = tmp_path / "runs" / "ref"
    step4 = ref / "checkpoints" / "step-000004"
    assert sorted(p.name for p in (step4 / "optimizer").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    meta = json.loads((step4 / "meta.json").read_text())
    assert "optimizer/__1_0.distcp" in meta["files"]  # the shards are checksummed like every other file

    proc = start("train", *sets("run.name=cut", "dist.strategy=fsdp", cache, *COMMON), "--nproc", "2",
                 "--max-restarts", "1", cwd=tmp_path)
    latest = tmp_path / "runs" / "cut" / "checkpoints" / "latest"
    wait_until(latest.exists, proc)
    os.kill(min(_workers(proc.pid)), signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "resuming from" in out
    cut = tmp_path / "runs" / "cut"
    mine = load_file(cut / "checkpoints" / "step-000012" / "model.safetensors")
    theirs = load_file(ref / "checkpoints" / "step-000012" / "model.safetensors")
    assert all(mine[k].equal(theirs[k]) for k in theirs)
    assert _losses(cut) == _losses(ref)

    # FSDP starts from ShardInit's weights, DDP from GPT(cfg)'s: FSDP and DDP from the same weights train alike in
    # tests/distributed/test_parallelize.py

    # a sharded optimizer cannot silently become a fresh one in a single process
    single = kubetrain("train", *sets("run.name=ref", cache, *COMMON, "train.max_steps=16"), cwd=tmp_path,
                       check=False)
    assert single.returncode == 2 and "sharded (FSDP) optimizer" in single.stderr

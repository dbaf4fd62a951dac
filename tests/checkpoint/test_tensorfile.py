"""checkpoint.tensorfile: our safetensors writer's files load with the library; trainer state round-trips."""

from __future__ import annotations

from pathlib import Path

import torch

from kubetrain import checkpoint
from tests.checkpoint.conftest import tiny_state


def test_files_are_standard_safetensors_and_the_trainer_state_round_trips(tmp_path: Path) -> None:
    from safetensors import safe_open

    opt_state = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 3).to(torch.bfloat16)},
                           1: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(0)}},
                 "param_groups": [{"lr": 0.1, "params": [0, 1], "betas": (0.9, 0.95)}]}
    trainer = {"optimizer": opt_state, "loader": {"cursor": 12}, "rng": [torch.get_rng_state()], "flag": None}
    ck = checkpoint.save(tmp_path, 1, tiny_state(), trainer, {}, keep_last=1)
    with safe_open(str(ck.path / "model.safetensors"), framework="pt") as f:  # the library reads our writer's file
        assert sorted(f.keys()) == ["embed.weight", "norm.weight"]
        assert f.get_tensor("embed.weight").equal(tiny_state()["embed.weight"])
    back = checkpoint.verify(ck.path).trainer_state()
    assert back["loader"] == {"cursor": 12} and back["flag"] is None
    assert back["optimizer"]["param_groups"] == opt_state["param_groups"]
    assert back["optimizer"]["state"][0]["exp_avg"].equal(opt_state["state"][0]["exp_avg"])
    assert back["optimizer"]["state"][0]["exp_avg"].dtype == torch.bfloat16
    assert back["optimizer"]["state"][1]["exp_avg"].shape == (0,)

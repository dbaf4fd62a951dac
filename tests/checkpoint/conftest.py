"""Helpers of the checkpoint tests: a tiny model state with tied weights and one call that saves it.

The S3-compatible server of the object-storage tests (fixtures `s3_endpoint`, `bucket`) is in tests/object_store.py.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kubetrain import checkpoint


def tiny_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(16, 8, generator=g)
    return {"embed.weight": emb, "lm_head.weight": emb, "norm.weight": torch.ones(8)}


def save_step(root: Path, step: int, keep_last: int = 2, best: bool = False) -> checkpoint.Checkpoint:
    trainer = {"optimizer": {"state": {}, "param_groups": []}, "step": step, "rng": [torch.get_rng_state()]}
    return checkpoint.save(root, step, tiny_state(step), trainer, {"tokens": step * 10}, keep_last=keep_last,
                           is_best=best)

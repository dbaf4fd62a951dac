"""Helpers of the checkpoint tests: a tiny model state with tied weights and one call that saves it.

The S3-compatible server of the object-storage tests (fixtures `s3_endpoint`, `bucket`) is in tests/object_store.py.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
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


def age_files(folder: Path) -> None:
    """Its files as a later start finds them: older than the window in which an mtime cannot be trusted."""
    old = time.time() - 60
    for f in folder.rglob("*"):
        os.utime(f, (old, old))


def count_hashing(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the files checkpoint reading hashes from now on, in order."""
    from kubetrain.checkpoint import verdict

    hashed: list[str] = []
    digest = verdict.file_digest

    def spy(path: Path) -> str:
        hashed.append(path.name)
        return digest(path)

    monkeypatch.setattr(verdict, "file_digest", spy)
    return hashed

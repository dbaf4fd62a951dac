"""Loading a trained model back: a pointed-to checkpoint that does not verify is skipped, with a warning."""

from __future__ import annotations

from pathlib import Path

import pytest

from kubetrain.config.loading import validate
from kubetrain.models.load import locate
from kubetrain.train.trainer import train


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("load")
    cfg = validate({
        "run": {"name": "r", "output_dir": str(root), "threads": 1},
        "model": {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16},
        "train": {"max_steps": 2, "micro_batch_size": 2, "warmup_steps": 0},
        "eval": {"every_steps": 1, "windows": 1, "sample_tokens": 2},
        "checkpoint": {"every_steps": 1},
        "track": {"console": False},
    })
    return Path(train(cfg, argv=[], log=lambda m: None).run_dir)


def test_a_corrupt_best_is_named_in_a_warning_and_another_is_used(run_dir: Path) -> None:
    root = run_dir / "checkpoints"
    best = (root / "best").read_text().strip()
    weights = root / best / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    warnings: list[str] = []
    _, ckpt = locate(run_dir, "best", warn=warnings.append)
    assert ckpt.path.name != best
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: checkpoint {best} does not verify")
    assert "checksum" in warnings[0]

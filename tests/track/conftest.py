"""Fixtures for the tracker tests: a tiny real training run with the sinks a test turns on."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kubetrain.config import load_config
from kubetrain.train.trainer import TrainResult, train

# A 1-layer model that trains 20 steps in a second or two on one thread: logs at 5, 10, 15, 20 and
# evaluates (and, while val loss improves, checkpoints) at the same steps.
TINY = [
    "run.name=obs",
    "run.threads=1",
    "model.n_layer=1",
    "model.n_head=2",
    "model.n_embd=32",
    "model.block_size=32",
    "train.max_steps=20",
    "train.micro_batch_size=4",
    "train.warmup_steps=2",
    "train.log_every_steps=5",
    "eval.every_steps=5",
    "eval.windows=2",
    "eval.sample_tokens=8",
    "checkpoint.every_steps=10",
]
TOKENS_PER_STEP = 4 * 32


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One prepared-data cache for the whole session (prepared data is cached by content hash)."""
    return tmp_path_factory.mktemp("data-cache")


TrainTiny = Callable[..., TrainResult]


@pytest.fixture
def train_tiny(tmp_path: Path, data_cache: Path) -> TrainTiny:
    """train_tiny("track.mlflow.enabled=true", ...): the real loop on the tiny config, in tmp_path/runs."""

    def run(*overrides: str, output_dir: Path | None = None) -> TrainResult:
        sets = [*TINY, f"run.output_dir={output_dir or tmp_path / 'runs'}", f"data.cache_dir={data_cache}",
                *overrides]
        return train(load_config(None, None, sets), argv=[], log=lambda _: None)

    return run

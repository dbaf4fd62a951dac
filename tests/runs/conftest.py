"""Fixtures for reading runs back: two finished tiny runs made by the real loop (the tracker tests' config)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kubetrain.config import load_config
from kubetrain.train.trainer import train
from tests.track.conftest import TINY, TOKENS_PER_STEP
from tests.train.conftest import _no_leftover_processes as _no_leftover_processes  # the lock tests start runs

__all__ = ["TOKENS_PER_STEP"]


@pytest.fixture(scope="session")
def two_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two finished tiny runs that differ in name and learning rate only: 'obs' (3e-3) and 'slow' (1e-3)."""
    out = tmp_path_factory.mktemp("two-runs")
    cache = tmp_path_factory.mktemp("data-cache")
    paths = []
    for extra in (["run.name=obs"], ["run.name=slow", "train.lr=1e-3"]):
        sets = [*TINY, f"run.output_dir={out}", f"data.cache_dir={cache}", *extra]
        paths.append(Path(train(load_config(None, None, sets), argv=[], log=lambda _: None).run_dir))
    return paths[0], paths[1]

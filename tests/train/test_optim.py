"""The LR schedule: warmup, peak, cosine to the floor at the step where the run really ends."""

from __future__ import annotations

import itertools

import pytest

from kubetrain.config.schema import TrainConfig
from kubetrain.train.optim import lr_at


def schedule(**fields: float) -> TrainConfig:
    return TrainConfig(**{"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 10, "max_steps": 100, **fields})


def test_warmup_rises_linearly_to_the_peak() -> None:
    cfg = schedule()
    assert lr_at(0, cfg, 100) == pytest.approx(1e-4)
    assert lr_at(4, cfg, 100) == pytest.approx(5e-4)
    assert lr_at(9, cfg, 100) == pytest.approx(1e-3)
    assert lr_at(10, cfg, 100) == pytest.approx(1e-3)  # the cosine starts at the peak


def test_cosine_reaches_the_floor_on_the_last_step() -> None:
    cfg = schedule()
    assert lr_at(55, cfg, 101) == pytest.approx(5.5e-4)  # halfway from step 10 to step 100: mean of peak and floor
    assert lr_at(99, cfg, 100) == pytest.approx(1e-4)  # the 100th step (99 done before it) trains at the floor
    assert lr_at(98, cfg, 100) > 1e-4
    assert lr_at(500, cfg, 100) == pytest.approx(1e-4)  # past the end it stays at the floor
    # a run that max_tokens ends after 40 steps decays over 40 steps, not over max_steps
    assert lr_at(39, cfg, 40) == pytest.approx(1e-4)
    assert lr_at(39, cfg, 40) < lr_at(39, cfg, 100)


def test_the_default_floor_is_a_tenth_of_the_peak() -> None:
    assert lr_at(100, schedule(min_lr=None), 100) == pytest.approx(1e-4)  # type: ignore[arg-type]


def test_a_resume_in_the_middle_continues_the_same_curve() -> None:
    cfg = schedule()
    uninterrupted = [lr_at(s, cfg, 100) for s in range(100)]
    resumed = [lr_at(s, cfg, 100) for s in range(37)] + [lr_at(s, cfg, 100) for s in range(37, 100)]
    assert resumed == uninterrupted
    assert all(a >= b for a, b in itertools.pairwise(uninterrupted[10:]))

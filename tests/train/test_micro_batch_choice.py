"""train/micro_batch_choice.py: the pure choice of `micro_batch_size: auto`, a function of numbers."""

from __future__ import annotations

import pytest

from kubetrain.errors import UserInputError
from kubetrain.train.micro_batch_choice import MicroBatchChoice, accum_steps, candidates, choose, per_process_batch


def test_the_candidates_divide_the_batch_of_one_process() -> None:
    assert candidates(64) == [64, 32, 16, 8, 4, 2, 1]  # powers of two: halving
    assert candidates(12) == [12, 6, 4, 3, 2, 1]  # otherwise each step down keeps the accumulation whole
    assert candidates(1) == [1]


def test_choose_takes_the_largest_that_fits_and_says_when_none_does() -> None:
    need = {16: 1600, 8: 800, 4: 400, 2: 200, 1: 100}.__getitem__
    assert choose([1, 2, 4, 8, 16], need, 1000) == MicroBatchChoice(8, (16, 8, 4, 2, 1), 800, 1000, True)
    assert choose([16, 8, 4, 2, 1], need, 800).micro_batch == 8  # exactly the budget fits
    asked: list[int] = []
    sizes = candidates(1024)  # 11 sizes: a binary search asks the estimate 4 times, not 11
    assert choose(sizes, lambda b: asked.append(b) or b, 100).micro_batch == 64 and len(asked) <= 4
    none = choose([16, 8, 4, 2, 1], need, 50)
    assert (none.micro_batch, none.fits, none.need) == (1, False, 100)
    assert "the smallest of 16, 8, 4, 2, 1, though its memory estimate" in none.describe()


def test_the_plan_of_a_batch_keeps_the_global_batch_or_says_why_not() -> None:
    assert per_process_batch(64, 4) == 16 and accum_steps(16, 4, 64, 4) == 4  # 4 x 4 accum x 4 processes = 64
    with pytest.raises(UserInputError, match="not a multiple of the 3 processes"):
        per_process_batch(64, 3)
    with pytest.raises(UserInputError, match="micro_batch_size 3 does not divide the 16 sequences"):
        accum_steps(16, 3, 64, 4)

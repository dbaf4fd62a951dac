"""The loader: fixed windows by position, one global cursor, disjoint rank slices, exact state round trip."""

from __future__ import annotations

import random
import string
from pathlib import Path

import numpy as np
import pytest
import torch

from kubetrain.config import load_config
from kubetrain.data.loader import IGNORE_INDEX, Batch, TokenWindows, TrainLoader
from kubetrain.data.shards import Prepared, prepare

BLOCK = 8


@pytest.fixture
def prepared(tmp_path: Path) -> Prepared:
    # Seeded random letters: every window's content is unique, so a row of a batch names its window.
    rng = random.Random(0)
    text = "".join(rng.choice(string.ascii_letters) for _ in range(1000))
    f = tmp_path / "c.txt"
    f.write_text(text)
    cfg = load_config(overrides=[f"data.cache_dir={tmp_path / 'cache'}", "data.sources.0.kind=text",
                                 f"data.sources.0.path={f}", "data.val_fraction=0.1"])
    return prepare(cfg, min_tokens=BLOCK + 1)


def windows_of(prepared: Prepared, split: str = "train") -> TokenWindows:
    return TokenWindows(prepared, split, BLOCK)


def test_windows_are_next_token_pairs(prepared: Prepared) -> None:
    w = windows_of(prepared)
    assert len({rows(w.batch([i]))[0] for i in range(w.n_windows)}) == w.n_windows
    assert w.n_windows == (prepared.n_train - 1) // BLOCK
    batch = w.batch([0, 3])
    all_tokens = np.asarray(prepared.tokens()[:]).astype(np.int64)
    assert batch.input_ids.shape == batch.labels.shape == (2, BLOCK)
    assert batch.input_ids.dtype == batch.labels.dtype == torch.int64
    assert batch.input_ids[1].tolist() == all_tokens[3 * BLOCK : 4 * BLOCK].tolist()
    assert batch.labels[1].tolist() == all_tokens[3 * BLOCK + 1 : 4 * BLOCK + 1].tolist()
    assert batch.n_loss_tokens() == 2 * BLOCK


def test_val_windows_come_from_the_tail(prepared: Prepared) -> None:
    val = windows_of(prepared, "val")
    all_tokens = np.asarray(prepared.tokens()[:]).astype(np.int64)
    assert val.n_windows == (prepared.n_val - 1) // BLOCK
    first = val.batch([0]).input_ids[0].tolist()
    assert first == all_tokens[prepared.n_train : prepared.n_train + BLOCK].tolist()


def rows(batch: Batch) -> list[tuple[int, ...]]:
    return [tuple(r.tolist()) for r in batch.input_ids]


def test_cursor_is_deterministic(prepared: Prepared) -> None:
    a = TrainLoader(windows_of(prepared), 4, seed=7)
    b = TrainLoader(windows_of(prepared), 4, seed=7)
    for _ in range(10):
        assert torch.equal(a.next_batch().input_ids, b.next_batch().input_ids)
    assert a.cursor == 40
    other = TrainLoader(windows_of(prepared), 4, seed=8)
    assert not torch.equal(TrainLoader(windows_of(prepared), 4, seed=7).next_batch().input_ids,
                           other.next_batch().input_ids)


def test_each_epoch_visits_every_window_once_in_a_new_order(prepared: Prepared) -> None:
    loader = TrainLoader(windows_of(prepared), 1, seed=1)
    n = loader.windows.n_windows
    epoch0 = [loader.sample_index(s) for s in range(n)]
    epoch1 = [loader.sample_index(s) for s in range(n, 2 * n)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(n))
    assert epoch0 != epoch1
    for _ in range(n + 3):
        loader.next_batch()
    assert loader.epoch == pytest.approx((n + 3) / n)


def test_ranks_read_disjoint_slices_that_cover_the_global_batch(prepared: Prepared) -> None:
    world, batch = 2, 3
    r0 = TrainLoader(windows_of(prepared), batch, seed=5, rank=0, world=world)
    r1 = TrainLoader(windows_of(prepared), batch, seed=5, rank=1, world=world)
    single = TrainLoader(windows_of(prepared), batch * world, seed=5)
    for _ in range(6):
        a, b, both = r0.next_batch(), r1.next_batch(), single.next_batch()
        assert not set(rows(a)) & set(rows(b))
        # The global order does not depend on the world size: world 2 sees what world 1 sees, in order.
        assert rows(a) + rows(b) == rows(both)
    assert r0.cursor == r1.cursor == single.cursor == 36


def test_state_dict_round_trip_continues_exactly(prepared: Prepared) -> None:
    loader = TrainLoader(windows_of(prepared), 4, seed=3)
    for _ in range(5):
        loader.next_batch()
    state = loader.state_dict()
    expected = [loader.next_batch().input_ids for _ in range(30)]  # crosses an epoch boundary
    fresh = TrainLoader(windows_of(prepared), 4, seed=3)
    fresh.load_state_dict(state)
    assert fresh.cursor == 20
    assert all(torch.equal(fresh.next_batch().input_ids, e) for e in expected)


def test_state_resumes_with_another_world_size(prepared: Prepared) -> None:
    one = TrainLoader(windows_of(prepared), 4, seed=3)
    one.next_batch()
    state = one.state_dict()
    expected = rows(one.next_batch())
    halves = []
    for rank in (0, 1):
        part = TrainLoader(windows_of(prepared), 2, seed=3, rank=rank, world=2)
        part.load_state_dict(state)
        halves += rows(part.next_batch())
    assert halves == expected


def test_state_from_other_data_is_refused(prepared: Prepared) -> None:
    state = TrainLoader(windows_of(prepared), 4, seed=3).state_dict()
    other = TrainLoader(TokenWindows(prepared, "train", BLOCK * 2), 4, seed=3)
    with pytest.raises(ValueError, match="the data changed since the checkpoint"):
        other.load_state_dict(state)


def test_masked_shard_labels_are_ignored_where_the_mask_is_zero(prepared: Prepared) -> None:
    # A chat shard carries a mask per part; positions with mask 0 must not count in the loss.
    start = 0
    for segment in prepared.segments:
        n = segment["tokens"]
        mask = np.tile(np.array([1, 0], dtype=np.uint8), n // 2 + 1)[start % 2 : start % 2 + n]
        mask.tofile(prepared.folder / f"{segment['part']}.mask")
        start += n
    masked = Prepared(prepared.folder, {**prepared.meta, "masked": True})
    batch = TokenWindows(masked, "train", BLOCK).batch([0])
    # Label j is token j + 1, whose mask is 1 when j + 1 is even.
    expected = [IGNORE_INDEX if (j + 1) % 2 else batch.labels[0, j].item() for j in range(BLOCK)]
    assert batch.labels[0].tolist() == expected
    assert batch.n_loss_tokens() == BLOCK // 2


def test_loader_needs_windows(prepared: Prepared) -> None:
    with pytest.raises(ValueError, match="no training windows"):
        TrainLoader(TokenWindows(prepared, "val", 10_000), 1, seed=0)

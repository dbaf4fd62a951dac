"""Packed chat: whole conversations in best-fit-decreasing windows, little padding, each conversation once, and the
windows' position ids restarting at every conversation."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from kubetrain.config.loading import validate
from kubetrain.config.schema import Config
from kubetrain.data.chat import encode_conversations
from kubetrain.data.loader import IGNORE_INDEX, TokenWindows
from kubetrain.data.packing import IN_LOSS, STARTS_SEQUENCE, best_fit_decreasing, position_ids
from kubetrain.data.shards import prepare
from kubetrain.data.tokenizers import ByteTokenizer
from tests.hf_models import skewed_chat_rows

BLOCK = 1024


def reference_bfd(lengths: list[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing as the textbook states it: longest first, each into the first-opened bin among those
    with the least room that still fits it, a new bin when none does."""
    bins: list[list[int]] = []
    used: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fits = [b for b in range(len(bins)) if used[b] + lengths[i] <= capacity]
        if fits:
            b = min(fits, key=lambda b: (capacity - used[b], b))
        else:
            b = len(bins)
            bins.append([])
            used.append(0)
        bins[b].append(i)
        used[b] += lengths[i]
    return bins


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_best_fit_decreasing_is_the_textbook_algorithm(seed: int) -> None:
    rng = random.Random(seed)
    lengths = [rng.choice([rng.randint(1, 30), rng.randint(60, 100)]) for _ in range(300)]
    bins = best_fit_decreasing(lengths, 100)
    assert bins == reference_bfd(lengths, 100)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 100 for b in bins)


def test_a_sequence_longer_than_the_window_is_refused() -> None:
    with pytest.raises(ValueError, match="1 to 8"):
        best_fit_decreasing([3, 9], 8)


def test_positions_restart_at_every_start_and_at_the_window_edge() -> None:
    starts = torch.tensor([[False, False, True, False, False, True], [True, False, False, False, True, True]])
    assert position_ids(starts).tolist() == [[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 0, 0]]


@pytest.fixture(scope="module")
def skewed_chat(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("skewed") / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in skewed_chat_rows(400, 180)))
    return path


def config(out: Path, chat: Path, packing: bool) -> Config:
    return validate({"run": {"output_dir": str(out)},
                     "data": {"sources": [{"kind": "chat", "path": str(chat)}], "val_fraction": 0.1,
                              "chat": {"template": "chatml", "packing": packing}},
                     "model": {"block_size": BLOCK}})


def conversations_in(tokens: np.ndarray, flags: np.ndarray) -> list[tuple[int, ...]]:
    """The conversations of packed windows: from each start to the next, padding (no token in the loss) left out."""
    starts = [*list(np.flatnonzero(flags & STARTS_SEQUENCE)), len(tokens)]
    out = []
    for a, b in itertools.pairwise(starts):
        if (flags[a:b] & IN_LOSS).any():
            out.append(tuple(int(t) for t in tokens[a:b]))
    return out


def test_packed_windows_hold_every_conversation_once_with_at_most_3_percent_padding(
    tmp_path: Path, skewed_chat: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logged: list[str] = []
    packed = prepare(config(tmp_path, skewed_chat, packing=True), log=logged.append)
    tokens, flags = np.asarray(packed.tokens()[:]), np.asarray(packed.mask()[:])  # type: ignore[index]
    assert len(tokens) % BLOCK == 0
    assert (flags[::BLOCK] & STARTS_SEQUENCE).all()  # every window starts with a conversation
    cfg = config(tmp_path, skewed_chat, packing=True)
    alone = [tuple(ids) for ids, _ in encode_conversations(cfg.data.sources[0], ByteTokenizer(), cfg.data.chat,
                                                           BLOCK)]
    assert sorted(conversations_in(tokens, flags)) == sorted(alone)
    real = sum(len(c) for c in alone)
    assert 1 - real / len(tokens) <= 0.03
    lines = [m for m in logged if m.startswith("packing: ")]
    assert lines == [f"packing: {100 * real / len(tokens):.1f}% of positions are tokens "
                     f"({real:,} tokens in {len(tokens) // BLOCK:,} windows)"]


def test_packing_is_deterministic_and_validation_holds_the_unpacked_conversations(
    tmp_path: Path, skewed_chat: Path
) -> None:
    first = prepare(config(tmp_path / "a", skewed_chat, packing=True))
    again = prepare(config(tmp_path / "b", skewed_chat, packing=True))
    assert np.array_equal(np.asarray(first.tokens()[:]), np.asarray(again.tokens()[:]))
    unpacked = prepare(config(tmp_path / "a", skewed_chat, packing=False))  # one conversation per window
    cfg = config(tmp_path, skewed_chat, packing=True)
    alone = [tuple(ids) for ids, _ in encode_conversations(cfg.data.sources[0], ByteTokenizer(), cfg.data.chat,
                                                           BLOCK)]
    held_out = alone[len(alone) - unpacked.n_val // BLOCK :]
    tokens, flags = np.asarray(first.tokens()[first.n_train :]), np.asarray(first.mask()[first.n_train :])  # type: ignore[index]
    assert first.n_val % BLOCK == 0 and held_out
    assert sorted(conversations_in(tokens, flags)) == sorted(held_out)


def test_a_packed_batch_restarts_positions_and_never_labels_across_conversations(
    tmp_path: Path, skewed_chat: Path
) -> None:
    packed = prepare(config(tmp_path, skewed_chat, packing=True))
    windows = TokenWindows(packed, "train", BLOCK)
    batch = windows.batch(list(range(4)))
    assert batch.position_ids is not None
    flags = torch.from_numpy(np.array(packed.mask()[: 4 * BLOCK])).view(4, BLOCK)  # type: ignore[index]
    starts = (flags & STARTS_SEQUENCE) != 0
    assert ((batch.position_ids == 0) == starts).all()
    ends = torch.roll(starts, -1, dims=1)  # a conversation's last token: its label would be the next's first
    ends[:, -1] = True
    assert (batch.labels[ends] == IGNORE_INDEX).all()


def test_unpacked_chat_batches_carry_no_positions(tmp_path: Path, skewed_chat: Path) -> None:
    unpacked = prepare(config(tmp_path, skewed_chat, packing=False))
    assert TokenWindows(unpacked, "train", BLOCK).batch([0, 1]).position_ids is None


def test_a_chat_source_is_packed_like_any_window_count_at_another_world_size(tmp_path: Path,
                                                                              skewed_chat: Path) -> None:
    """Resumable at another world size: the packed windows are the loader's windows, drawn by one global cursor."""
    from kubetrain.data.loader import TrainLoader

    windows = TokenWindows(prepare(config(tmp_path, skewed_chat, packing=True)), "train", BLOCK)
    one = TrainLoader(windows, 2, seed=3)
    seen_one = [one.next_batch().input_ids for _ in range(4)]
    two = [TrainLoader(windows, 1, seed=3, rank=r, world=2) for r in range(2)]
    seen_two = [torch.cat([loader.next_batch().input_ids for loader in two]) for _ in range(4)]
    for a, b in zip(seen_one, seen_two, strict=True):
        assert torch.equal(a, b)


def test_document_attention_flags_each_document_of_a_text_source(tmp_path: Path) -> None:
    for name, text in (("a.txt", "first document " * 20), ("b.txt", "second one " * 30)):
        (tmp_path / name).write_text(text)
    raw = {"run": {"output_dir": str(tmp_path)},
           "data": {"sources": [{"kind": "text", "path": str(tmp_path / "*.txt")}], "val_fraction": 0.0,
                    "attention": "document"},
           "model": {"block_size": 64}}
    prepared = prepare(validate(raw))
    flags = np.asarray(prepared.mask()[:])  # type: ignore[index]
    first = len(ByteTokenizer().encode("first document " * 20 + "\n\n"))
    assert list(np.flatnonzero(flags & STARTS_SEQUENCE)) == [0, first]
    assert (flags & IN_LOSS).all()
    batch = TokenWindows(prepared, "train", 64).batch([first // 64])
    assert batch.position_ids is not None and batch.position_ids[0, first % 64] == 0
    causal = prepare(validate({**raw, "data": {**raw["data"], "attention": "causal"}}))  # type: ignore[dict-item]
    assert causal.mask() is None and np.array_equal(np.asarray(causal.tokens()[:]), np.asarray(prepared.tokens()[:]))


def test_document_attention_on_one_conversation_per_window_is_a_quiet_no_op(
    tmp_path: Path, skewed_chat: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = config(tmp_path, skewed_chat, packing=False).model_dump(mode="json")
    raw["data"]["attention"] = "document"
    prepared = prepare(validate(raw))
    assert TokenWindows(prepared, "train", BLOCK).batch([0, 1, 2]).position_ids is None  # plain causal attention
    assert capsys.readouterr().err == ""

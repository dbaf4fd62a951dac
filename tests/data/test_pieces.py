"""Long texts cut where tokenizers split: the pieces encode to the ids of the whole text; parts never overlap."""

from __future__ import annotations

import io
import itertools

import numpy as np
import pytest

from kubetrain.data.pieces import boundary, text_pieces
from kubetrain.data.sources import builtin_corpus_path
from kubetrain.data.tokenizers import FastTokenizer, encode_texts, train_bpe

UNICODE = "Ça va très bien.\nΓειά σου κόσμε!\n日本語のテキスト。\n  indented\n\nblank above\r\nwindows line\n"


@pytest.fixture(scope="module")
def bpe() -> FastTokenizer:
    text = builtin_corpus_path().read_text(encoding="utf-8")
    return train_bpe([text[:200_000], UNICODE * 50], 1024)


@pytest.mark.parametrize("piece_bytes", [300, 4096, 1 << 18])
def test_pieces_encode_to_the_ids_of_the_whole_text(bpe: FastTokenizer, piece_bytes: int) -> None:
    text = builtin_corpus_path().read_text(encoding="utf-8")[:300_000] + UNICODE * 300
    raw = text.encode("utf-8")
    pieces = list(text_pieces(io.BytesIO(raw), 0, len(raw), piece_bytes))
    assert "".join(pieces) == text and len(pieces) > 1
    assert all(len(p.encode()) <= 2 * piece_bytes for p in pieces)  # bounded, whatever the text's size
    whole = bpe.tok.encode(text, add_special_tokens=False).ids
    assert np.concatenate(encode_texts(bpe, pieces)).tolist() == whole


@pytest.mark.parametrize("lines", [False, True])
def test_parts_of_a_file_meet_exactly_and_encode_like_the_whole(bpe: FastTokenizer, lines: bool) -> None:
    raw = (builtin_corpus_path().read_text(encoding="utf-8")[:120_000] + UNICODE * 200).encode("utf-8")
    f = io.BytesIO(raw)
    step = 10_000
    cuts = [boundary(f, len(raw), a, step - 4, lines=lines) for a in range(0, len(raw), step)] + [len(raw)]
    assert cuts == sorted(cuts) and cuts[0] == 0
    if lines:
        assert all(raw[c - 1 : c] == b"\n" for c in cuts[1:-1])
        return
    ids = [i for a, b in itertools.pairwise(cuts) for p in encode_texts(bpe, list(text_pieces(f, a, b)))
           for i in p.tolist()]
    assert ids == bpe.tok.encode(raw.decode(), add_special_tokens=False).ids


def test_text_without_spaces_is_cut_at_character_starts() -> None:
    text = "日本語" * 50_000  # no place where a tokenizer surely splits: a hard cut, never inside a character
    raw = text.encode("utf-8")
    f = io.BytesIO(raw)
    pieces = list(text_pieces(f, 0, len(raw), 1000))
    assert "".join(pieces) == text and len(pieces) > 100
    cut = boundary(f, len(raw), 5001, 100, lines=False)
    assert raw[cut] & 0xC0 != 0x80 and 5001 <= cut < 5004

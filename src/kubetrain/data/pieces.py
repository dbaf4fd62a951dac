"""Text cut into pieces where tokenizers already split it, so a file of any size is encoded in bounded memory.

A cut goes where the pre-tokenizers of byte-level BPE (GPT-2, Llama 3, tiktoken's cl100k/o200k patterns)
always end a pre-token, so encoding the pieces one by one gives the same ids as encoding the whole text:
- after a single line break between two visible characters ("word\\nWord": "\\n" is a pre-token on its own
  whether or not the text goes on), or else
- before a single space between two visible characters ("word| word": the space starts the next pre-token).
Text with neither for a whole piece (a megabyte without a space) is cut at a character boundary; only there
can the ids differ from one whole encode. Tokenizers that mark the start of every text (sentencepiece's
prefix space) see each piece as a text start. The cut rule is part of the data's cache key (FORMAT_VERSION).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import BinaryIO

from kubetrain.errors import DataError

PIECE_BYTES = 1 << 18  # what one encode call gets from a long text: 256 KiB, ~64k tokens
_SEARCH_TRIES = 4096  # candidate separators looked at before falling back to the other kind, or a hard cut
_ASCII_TEXT = bytes(0 if chr(b).isspace() else 1 for b in range(128))


def _visible_before(buf: bytes, i: int) -> bool:
    """The character that ends at byte i-1 is not white space."""
    if i <= 0:
        return False
    b = buf[i - 1]
    if b < 0x80:
        return bool(_ASCII_TEXT[b])
    tail = buf[max(0, i - 4) : i].decode("utf-8", errors="ignore")
    return bool(tail) and not tail[-1].isspace()


def _visible_at(buf: bytes, i: int) -> bool:
    """The character that starts at byte i is not white space."""
    if i >= len(buf):
        return False
    b = buf[i]
    if b < 0x80:
        return bool(_ASCII_TEXT[b])
    head = buf[i : i + 4].decode("utf-8", errors="ignore")
    return bool(head) and not head[0].isspace()


def _is_cut(buf: bytes, p: int) -> bool:
    """Whether the text may be cut between bytes p-1 and p (see the module docstring)."""
    if p >= 2 and buf[p - 1] == 0x0A:  # after "\n"
        return _visible_before(buf, p - 1) and _visible_at(buf, p)
    if buf[p : p + 1] == b" ":  # before " "
        return _visible_before(buf, p) and _visible_at(buf, p + 1)
    return False


def last_cut(buf: bytes, lo: int) -> int:
    """The last place in buf (after byte lo) where the text may be cut, or -1 (the next byte must be in buf)."""
    for sep, shift in ((b"\n", 1), (b" ", 0)):
        end = len(buf)
        for _ in range(_SEARCH_TRIES):
            q = buf.rfind(sep, lo, end)
            if q < 0:
                break
            if q + shift > lo and _is_cut(buf, q + shift):
                return q + shift
            end = q
    return -1


def first_cut(buf: bytes, lo: int) -> int:
    """The first place in buf at or after byte lo where the text may be cut, or -1."""
    best = -1
    for sep, shift in ((b"\n", 1), (b" ", 0)):
        start = max(0, lo - shift)
        for _ in range(_SEARCH_TRIES):
            q = buf.find(sep, start)
            if q < 0 or (best >= 0 and q + shift >= best):
                break
            if q + shift >= lo and _is_cut(buf, q + shift):
                best = q + shift
                break
            start = q + 1
    return best


def char_start(buf: bytes, i: int) -> int:
    """i moved forward to the first byte of a UTF-8 character (past continuation bytes)."""
    while i < len(buf) and 0x80 <= buf[i] < 0xC0:
        i += 1
    return i


def boundary(f: BinaryIO, size: int, offset: int, span: int, *, lines: bool) -> int:
    """Where the part of a file that nominally starts at `offset` really starts (the previous one ends there).

    JSONL (`lines`): after the first line break at or after offset, however far. Text: the first cut at or after
    offset closer than `span` bytes, else offset moved to a character start; with span below the part size,
    parts never overlap. Read in blocks: bounded memory. The same arguments always give the same answer,
    so the two processes that need a boundary (the parts on either side) agree without talking.
    """
    if offset <= 0:
        return 0
    if offset >= size:
        return size
    pos = offset - 1  # buf[0] is the byte before offset: a cut right at offset is seen with its neighbour
    f.seek(pos)
    buf = f.read(PIECE_BYTES)
    while True:
        if lines:
            q = buf.find(b"\n")
            if q >= 0:
                return pos + q + 1
        else:
            p = first_cut(buf, max(1, offset - pos))
            if p >= 0:
                return pos + p if pos + p < offset + span else _char_start_at(f, offset)
            if pos + len(buf) >= offset + span:
                return _char_start_at(f, offset)
        more = f.read(PIECE_BYTES)
        if not more:
            return size
        keep = min(len(buf), 8)  # a cut's neighbours can straddle two blocks
        pos += len(buf) - keep
        buf = buf[len(buf) - keep :] + more


def _char_start_at(f: BinaryIO, offset: int) -> int:
    f.seek(offset)
    return offset + char_start(f.read(4), 0)


def text_pieces(f: BinaryIO, start: int, end: int, piece_bytes: int = PIECE_BYTES) -> Iterator[str]:
    """The text of bytes [start, end) of a file in pieces of about piece_bytes, cut where tokenizers split."""
    f.seek(start)
    left, pos = end - start, start  # pos: the file offset of carry's first byte
    carry = b""
    while True:
        data = f.read(min(piece_bytes, left)) if left > 0 else b""
        left -= len(data)
        buf = carry + data
        if left <= 0:
            if buf:
                yield _decode(buf, f, pos)
            return
        if len(buf) < piece_bytes:
            carry = buf
            continue
        p = last_cut(buf, 0)
        if p <= 0:  # no place to cut in a whole piece: before the last character, which may be incomplete
            p = len(buf) - 1
            while p > 0 and 0x80 <= buf[p] < 0xC0:
                p -= 1
            p = p or len(buf)
        yield _decode(buf[:p], f, pos)
        carry, pos = buf[p:], pos + p


def _decode(buf: bytes, f: BinaryIO, pos: int) -> str:
    try:
        return buf.decode("utf-8")
    except UnicodeDecodeError as e:
        name = getattr(f, "name", "data file")
        raise DataError(f"{name}: not UTF-8 text (invalid byte at offset {pos + e.start})") from None

"""The sources cut into parts that processes tokenize independently, and the writing of one part.

A part is a byte range of a text or JSONL file (about data.part_mb), a range of rows of a dataset, or a whole
chat source. The plan depends only on the config and the files' sizes, never on how many processes share the
work, so any number of ranks, pods or `prepare --nproc` workers produce the same token files.
"""

from __future__ import annotations

import io
import json
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import xxhash

from kubetrain.config.schema import Config, SourceConfig
from kubetrain.data import sources
from kubetrain.data.claims import process_tag
from kubetrain.data.packing import IN_LOSS, STARTS_SEQUENCE, packed_windows
from kubetrain.data.pieces import PIECE_BYTES, boundary, text_pieces
from kubetrain.data.tokenizers import ByteTokenizer, Tokenizer, encode_texts
from kubetrain.errors import DataError

PARTS_DIR = "parts"
BATCH_BYTES = 4 << 20  # text handed to one batch encode: a few pieces, so every core has one
BATCH_DOCS = 4096


@dataclass(frozen=True)
class Part:
    """One unit of tokenizing work: `source`'s file `doc` (its ordinal) from nominal offset start to end."""

    index: int
    source: int
    kind: str  # text | jsonl | hf | chat
    path: str | None
    doc: int  # the file's ordinal in its source (text: the document's)
    start: int  # bytes of the file (text, jsonl) or rows (hf); nominal, the real cut is found when written
    end: int
    size: int  # the file's bytes or the dataset's rows
    span: int  # how far past a nominal start a text cut is looked for

    @property
    def name(self) -> str:
        return f"{PARTS_DIR}/{self.index:05d}"

    @property
    def ends_document(self) -> bool:
        return self.kind == "text" and self.end >= self.size


def plan(cfg: Config) -> list[Part]:
    """Every part of every source, in the order their tokens are joined (weights are applied when joining)."""
    step = max(1, int(cfg.data.part_mb * 2**20))
    parts: list[Part] = []
    for s, src in enumerate(cfg.data.sources):
        if src.kind == "chat":
            parts.append(Part(len(parts), s, "chat", None, 0, 0, 1, 1, 0))
        elif src.kind == "hf":
            rows, nbytes = _dataset_size(src)
            n = max(1, math.ceil(nbytes / step))
            per = max(1, math.ceil(rows / n))
            for a in range(0, rows, per):
                parts.append(Part(len(parts), s, "hf", None, 0, a, min(rows, a + per), rows, 0))
        else:
            kind = "jsonl" if src.kind == "jsonl" else "text"
            for d, f in enumerate(sources.source_files(src)):
                size = f.stat().st_size
                for a in range(0, size, step):
                    parts.append(Part(len(parts), s, kind, str(f), d, a, min(size, a + step), size,
                                      max(1, step - 4)))
    return parts


def _dataset_size(src: SourceConfig) -> tuple[int, int]:
    ds = sources.load_hf_dataset(src)
    return len(ds), int(getattr(getattr(ds, "data", None), "nbytes", 0) or len(ds) * 1024)


def document_separator(tok: Tokenizer) -> np.ndarray:
    """EOS after each document; a blank line for the byte tokenizer, as its shards always had (its EOS came
    later): the same corpus keeps giving the same tokens, so runs trained on them still resume."""
    if tok.eos_id is None or isinstance(tok, ByteTokenizer):
        return encode_texts(tok, ["\n\n"])[0]
    return np.asarray([tok.eos_id], dtype=np.uint32)


class PartWriter:
    """Token (and mask) files of one part, checksummed as they are written, renamed into place when complete."""

    def __init__(self, folder: Path, part: Part, dtype: np.dtype[Any], masked: bool, doc_ends: bool) -> None:
        self.folder, self.part, self.dtype = folder, part, dtype
        self.suffix = f".tmp-{process_tag()}"
        self.names = [f"{part.name}.bin"] + ([f"{part.name}.mask"] if masked else [])
        self.files = [open(folder / (n + self.suffix), "wb") for n in self.names]  # noqa: SIM115
        self.hashes = [xxhash.xxh3_128() for _ in self.names]
        self.tokens = 0
        self.ends: list[int] | None = [] if doc_ends else None
        self.info: dict[str, Any] = {}  # more for the part's .json (packed chat: where validation starts, padding)
        self._starts = False

    def start_document(self) -> None:
        """Flag the next token added as the start of a document (data.attention: document)."""
        self._starts = True

    def add(self, ids: np.ndarray, mask: np.ndarray | None = None) -> None:
        blobs = [ids.astype(self.dtype, copy=False).tobytes()]
        if len(self.files) > 1:
            flags = (mask if mask is not None else np.full(len(ids), IN_LOSS, np.uint8)).astype(np.uint8)
            if self._starts and len(ids):
                flags[0] |= STARTS_SEQUENCE
                self._starts = False
            blobs.append(flags.tobytes())
        for f, h, b in zip(self.files, self.hashes, blobs, strict=True):
            f.write(b)
            h.update(b)
        self.tokens += len(ids)

    def end_document(self) -> None:
        if self.ends is not None:
            self.ends.append(self.tokens)

    def commit(self) -> dict[str, Any]:
        """Flush, fsync and rename the files; the part's .json, written last, says it is complete."""
        for f in self.files:
            f.flush()
            os.fsync(f.fileno())
            f.close()
        for n in self.names:
            os.replace(self.folder / (n + self.suffix), self.folder / n)
        info: dict[str, Any] = {"tokens": self.tokens, "checksums": {
            n: h.hexdigest() for n, h in zip(self.names, self.hashes, strict=True)}, **self.info}
        if self.ends is not None:
            info["doc_ends"] = self.ends
        tmp = self.folder / f"{self.part.name}.json{self.suffix}"
        tmp.write_text(json.dumps(info))
        os.replace(tmp, self.folder / f"{self.part.name}.json")
        return info

    def abort(self) -> None:
        for f, n in zip(self.files, self.names, strict=True):
            f.close()
            (self.folder / (n + self.suffix)).unlink(missing_ok=True)


def write_part(cfg: Config, tok: Tokenizer, part: Part, folder: Path, dtype: np.dtype[Any], masked: bool) -> None:
    """Tokenize one part into folder/parts/NNNNN.{bin,mask,json}."""
    (folder / PARTS_DIR).mkdir(parents=True, exist_ok=True)
    src = cfg.data.sources[part.source]
    doc_ends = part.kind in ("jsonl", "hf") and src.weight % 1 > 0  # a fractional copy ends mid-part
    writer = PartWriter(folder, part, dtype, masked, doc_ends)
    documents = cfg.data.attention == "document"
    try:
        if part.kind == "chat":
            from kubetrain.data.chat import encode_conversations

            conversations = encode_conversations(src, tok, cfg.data.chat, block_size=cfg.model.block_size)
            if cfg.data.chat.packing:
                _write_packed(cfg, tok, part, writer, conversations)
            else:  # one conversation per window
                for conv, mask in conversations:
                    writer.add(np.asarray(conv, dtype=np.int64), np.asarray(mask, dtype=np.uint8))
        elif part.kind == "text":
            if documents and part.start == 0:  # a text source's document is a file
                writer.start_document()
            with open(part.path or "", "rb") as f:
                a, b = _real_range(f, part)
                for batch in _batches(text_pieces(f, a, b)):
                    for piece in encode_texts(tok, batch):
                        writer.add(piece)
            if part.ends_document and part.size > 0:
                writer.add(document_separator(tok))
        else:
            sep = document_separator(tok)
            docs = _jsonl_texts(src, part) if part.kind == "jsonl" else _dataset_texts(src, part)
            for batch in _batches(docs):
                for text, ids in zip(batch, _encode_documents(tok, batch), strict=True):
                    if text:
                        if documents:
                            writer.start_document()
                        writer.add(ids)
                        writer.add(sep)
                    writer.end_document()
    except BaseException:
        writer.abort()
        raise
    writer.commit()


def _write_packed(cfg: Config, tok: Tokenizer, part: Part, writer: PartWriter,
                  conversations: Iterable[tuple[list[int], list[int]]]) -> None:
    """A chat source's conversations in packed windows (data/packing.py), written window after window.

    When the source is the last one (the validation split is its tail), its last `data.val_fraction` of the
    conversations are packed on their own after the others: validation holds the same conversations packed as
    unpacked, and the split falls between windows. The part's .json records where they start and the padding."""
    from kubetrain.data.chat import pad_id

    convs = [(np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.uint8)) for ids, mask in conversations]
    last = part.source == len(cfg.data.sources) - 1
    n_val = int(len(convs) * cfg.data.val_fraction) if last else 0
    block, pad = cfg.model.block_size, pad_id(tok)
    for ids, flags in packed_windows(convs[: len(convs) - n_val], block, pad):
        writer.add(ids, flags)
    val_from = writer.tokens
    for ids, flags in packed_windows(convs[len(convs) - n_val :], block, pad):
        writer.add(ids, flags)
    writer.info.update({"val_from": val_from if last else None,
                        "packing": {"tokens": sum(len(ids) for ids, _ in convs), "positions": writer.tokens,
                                    "windows": writer.tokens // block}})


def _real_range(f: BinaryIO, part: Part) -> tuple[int, int]:
    lines = part.kind == "jsonl"
    return (boundary(f, part.size, part.start, part.span, lines=lines),
            boundary(f, part.size, part.end, part.span, lines=lines))


def _batches(texts: Iterable[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for t in texts:
        batch.append(t)
        size += len(t)
        if size >= BATCH_BYTES or len(batch) >= BATCH_DOCS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _encode_documents(tok: Tokenizer, docs: list[str]) -> list[np.ndarray]:
    """The ids of each document; one longer than a piece is encoded in pieces (see pieces.py) and joined."""
    if all(len(t) <= PIECE_BYTES for t in docs):
        return encode_texts(tok, docs)
    flat: list[str] = []
    owner: list[int] = []
    for i, t in enumerate(docs):
        raw = t.encode("utf-8")
        cut = [t] if len(t) <= PIECE_BYTES else list(text_pieces(io.BytesIO(raw), 0, len(raw)))
        flat += cut
        owner += [i] * len(cut)
    ids: list[list[np.ndarray]] = [[] for _ in docs]
    for i, piece in zip(owner, encode_texts(tok, flat), strict=True):
        ids[i].append(piece)
    return [np.concatenate(p) if len(p) != 1 else p[0] for p in ids]


def _jsonl_texts(src: SourceConfig, part: Part) -> Iterator[str]:
    """The text field of every row whose line starts in the part's byte range (blank lines are not rows)."""
    path = Path(part.path or "")
    with open(path, "rb") as f:
        a, b = _real_range(f, part)
        f.seek(a)
        pos = a
        while pos < b:
            line = f.readline()
            if not line:
                break
            where = pos
            pos += len(line)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise DataError(f"{path}:{_line_number(path, where)}: not valid JSON "
                                f"({getattr(e, 'msg', e)})") from None
            if not isinstance(row, dict) or src.text_field not in row:
                raise DataError(f"{path}:{_line_number(path, where)}: no '{src.text_field}' field")
            text = row[src.text_field]
            if not isinstance(text, str):
                raise DataError(f"{path}:{_line_number(path, where)}: field '{src.text_field}' is not a string")
            yield text


def _line_number(path: Path, offset: int) -> int:
    """The 1-based line that starts at byte offset (counted only when there is an error to report)."""
    n = 1
    with open(path, "rb") as f:
        while offset > 0:
            block = f.read(min(offset, 1 << 20))
            if not block:
                break
            n += block.count(b"\n")
            offset -= len(block)
    return n


def _dataset_texts(src: SourceConfig, part: Part) -> Iterator[str]:
    ds = sources.load_hf_dataset(src)
    for a in range(part.start, part.end, 1000):
        column = ds[a : min(part.end, a + 1000)].get(src.text_field)
        if column is None or not all(isinstance(t, str) for t in column):
            raise DataError(f"dataset '{src.path}': rows need a string field '{src.text_field}'")
        yield from column

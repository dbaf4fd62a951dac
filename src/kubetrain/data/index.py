"""The shard index: the parts of a prepared dataset joined in order, and read as one token sequence.

Joining copies nothing: meta.json lists segments (a part's file, or a prefix of it, or a run of padding),
a source of weight 2 lists its parts twice, and the loader reads across segment ends.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kubetrain.config.schema import Config
from kubetrain.data import sources
from kubetrain.data.parts import Part

Segment = dict[str, Any]  # {"part": "parts/00003", "tokens": n} or {"pad": n, "id": pad_id}


def length(segment: Segment) -> int:
    return int(segment["tokens"] if "tokens" in segment else segment["pad"])


def join(cfg: Config, parts: list[Part], infos: dict[int, dict[str, Any]], pad: int) -> list[Segment]:
    """The segments of the dataset: each source's parts `weight` times, a fraction as its first documents."""
    segments: list[Segment] = []
    total = 0

    def add(part: Part, tokens: int | None = None) -> None:
        nonlocal total
        n = infos[part.index]["tokens"] if tokens is None else tokens
        if n:
            segments.append({"part": part.name, "tokens": n})
            total += n

    for s, src in enumerate(cfg.data.sources):
        own = [p for p in parts if p.source == s]
        if src.kind == "chat":  # the copies are inside the part, laid out in windows: it starts on a boundary
            if total % cfg.model.block_size:
                fill = cfg.model.block_size - total % cfg.model.block_size
                segments.append({"pad": fill, "id": pad})
                total += fill
            add(own[0])
            continue
        whole, frac = divmod(src.weight, 1.0)
        for _ in range(int(whole)):
            for p in own:
                add(p)
        if not frac:
            continue
        if src.kind in ("text", "builtin"):  # a document is a file
            keep = int(len(sources.source_files(src)) * frac)
            for p in own:
                if p.doc < keep:
                    add(p)
            continue
        keep = int(sum(len(infos[p.index]["doc_ends"]) for p in own) * frac)
        for p in own:
            ends = infos[p.index]["doc_ends"]
            if keep >= len(ends):
                add(p)
                keep -= len(ends)
            else:
                if keep:
                    add(p, ends[keep - 1])
                break
    return segments


class TokenSequence:
    """Tokens [start, end) of the joined segments, read through memory maps opened when first needed."""

    def __init__(self, folder: Path, segments: list[Segment], dtype: np.dtype[Any], suffix: str = ".bin",
                 start: int = 0, end: int | None = None) -> None:
        self.folder, self.segments, self.dtype, self.suffix = folder, segments, dtype, suffix
        self.offsets = np.concatenate([[0], np.cumsum([length(s) for s in segments], dtype=np.int64)])
        self.start = start
        self.end = int(self.offsets[-1]) if end is None else end
        self._maps: dict[str, np.ndarray] = {}

    def __len__(self) -> int:
        return self.end - self.start

    def view(self, start: int, end: int) -> TokenSequence:
        """Tokens [start, end) of this sequence, sharing its maps."""
        out = TokenSequence.__new__(TokenSequence)
        out.__dict__.update(self.__dict__)
        out.start, out.end = self.start + start, self.start + min(end, len(self))
        return out

    def __getitem__(self, where: slice) -> np.ndarray:
        a, b, _ = where.indices(len(self))
        a, b = a + self.start, max(a, b) + self.start
        first = int(np.searchsorted(self.offsets, a, side="right")) - 1
        pieces = []
        i = first
        while a < b and i < len(self.segments):
            lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
            take = min(b, hi)
            pieces.append(self._segment(i)[a - lo : take - lo])
            a = take
            i += 1
        if len(pieces) == 1:
            return pieces[0]
        return np.concatenate(pieces) if pieces else np.empty(0, dtype=self.dtype)

    def _segment(self, i: int) -> np.ndarray:
        seg = self.segments[i]
        if "pad" in seg:  # padding: its token id, and no loss on it
            value = 0 if self.suffix == ".mask" else seg["id"]
            return np.full(seg["pad"], value, dtype=self.dtype)
        name = seg["part"] + self.suffix
        if name not in self._maps:
            self._maps[name] = np.memmap(self.folder / name, dtype=self.dtype, mode="r")
        return self._maps[name][: seg["tokens"]]

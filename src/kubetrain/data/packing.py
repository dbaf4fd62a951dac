"""Packing: whole sequences into windows by best-fit decreasing, and the flags that say where each sequence starts.

A packed window holds whole conversations and, at its end, padding; it carries where each of them starts, so the
model keeps every token inside its own sequence and counts positions from each start (models/documents.py).
Best-fit decreasing is Hugging Face TRL's `bfd` strategy: the longest sequences first, each into the fullest window
it still fits, found in O(log block_size) by a tree over the free space of the open windows.

The flags travel in the prepared data's `.mask` file (one byte per token): bit 0 says a token counts in the loss
(the label of the token before it), bit 1 that it starts a sequence.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence

import numpy as np
import torch

IN_LOSS = 1
STARTS_SEQUENCE = 2


class _FreeSpace:
    """The free space of the open windows, as a max tree over sizes 1..capacity: the smallest free space that still
    holds a sequence, in O(log capacity)."""

    def __init__(self, capacity: int) -> None:
        self.size = 1 << capacity.bit_length()
        self.tree = [0] * (2 * self.size)  # a leaf holds its size while some window has that much free

    def set(self, space: int, present: bool) -> None:
        i = self.size + space
        self.tree[i] = space if present else 0
        while i > 1:
            i //= 2
            self.tree[i] = max(self.tree[2 * i], self.tree[2 * i + 1])

    def smallest_at_least(self, need: int) -> int | None:
        if self.tree[1] < need:
            return None
        i = 1
        while i < self.size:
            i = 2 * i if self.tree[2 * i] >= need else 2 * i + 1
        return self.tree[i]


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins (lists of indices into `lengths`, each summing to at most `capacity`) by best-fit decreasing.

    Deterministic: ties in length keep the input order, a free space shared by several bins goes to the first bin
    opened. A bin lists its members in the order they were placed (longest first)."""
    if any(n > capacity or n < 1 for n in lengths):
        raise ValueError(f"every length must be 1 to {capacity}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    with_space: dict[int, list[int]] = {}  # free space -> a heap of the bins that have exactly that much
    free = _FreeSpace(capacity)
    for i in order:
        n = lengths[i]
        space = free.smallest_at_least(n)
        if space is None:
            b, space = len(bins), capacity
            bins.append([])
        else:
            waiting = with_space[space]
            b = heapq.heappop(waiting)
            if not waiting:
                del with_space[space]
                free.set(space, False)
        bins[b].append(i)
        left = space - n
        if left:
            heapq.heappush(with_space.setdefault(left, []), b)
            free.set(left, True)
    return bins


def packed_windows(sequences: Sequence[tuple[np.ndarray, np.ndarray]], block_size: int, pad_id: int
                   ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Windows of exactly `block_size` tokens: (ids, flags) of the sequences (ids, loss mask) binned together, then
    padding (a sequence of its own, out of the loss). Each sequence's first token is flagged as a start and out of
    the loss: it is only ever the label of another sequence's last token."""
    for members in best_fit_decreasing([len(ids) for ids, _ in sequences], block_size):
        ids = [sequences[i][0] for i in members]
        flags = []
        for i in members:
            f = (np.asarray(sequences[i][1], dtype=np.uint8) != 0).astype(np.uint8) * IN_LOSS
            f[0] = STARTS_SEQUENCE
            flags.append(f)
        fill = block_size - sum(len(x) for x in ids)
        if fill:
            ids.append(np.full(fill, pad_id, dtype=np.int64))
            flags.append(np.zeros(fill, dtype=np.uint8))
            flags[-1][0] = STARTS_SEQUENCE
        yield np.concatenate(ids).astype(np.int64), np.concatenate(flags)


def position_ids(starts: torch.Tensor) -> torch.Tensor:
    """(B, T) bool, True where a sequence starts -> (B, T) int64 positions counted from the last start (the window's
    first token always starts one: a sequence cut by the window's edge restarts there)."""
    t = torch.arange(starts.shape[1])
    starts = starts.clone()
    starts[:, 0] = True
    last_start = torch.where(starts, t, 0).cummax(dim=1).values
    return t - last_start

"""Fixed windows read by position. The loader's whole state is one cursor, so resume never replays or skips.

Sample s of the run (counted over all ranks) is window perm_e[s mod W] of epoch e = s // W, where W is the
number of windows and perm_e a permutation seeded by (seed, e). A global micro-batch is the next
world * batch samples; rank r takes its own contiguous slice. The order of samples therefore does not
depend on the world size, and a resume with another world size simply continues from the cursor.

A window of packed data (several sequences, `meta.json` "documents") also carries `position_ids` that restart at
0 where each sequence starts (data/packing.py): the model keeps each sequence to itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kubetrain.data.packing import IN_LOSS, STARTS_SEQUENCE, position_ids
from kubetrain.data.shards import Prepared

IGNORE_INDEX = -100


def counted_tokens(labels: torch.Tensor) -> torch.Tensor:
    """The positions of `labels` a loss counts (not IGNORE_INDEX), exactly: 0 for a window of prompt only. Every
    count of loss tokens (a step's window, an evaluation, a loss's mean) is this one."""
    return (labels != IGNORE_INDEX).sum()


@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, T) int64
    labels: torch.Tensor  # (B, T) int64, IGNORE_INDEX where no loss
    # (B, T) int64 restarting at 0 where a sequence starts: a packed batch; None: one causal sequence per window
    position_ids: torch.Tensor | None = None

    def to(self, device: torch.device) -> Batch:
        if device.type != "cuda":
            return Batch(self.input_ids.to(device), self.labels.to(device),
                         None if self.position_ids is None else self.position_ids.to(device))
        # nanoGPT (train.py get_batch): from pinned memory the copy is asynchronous; from pageable memory the
        # host would wait for it, and with it for the GPU, every micro-batch.
        def copied(t: torch.Tensor) -> torch.Tensor:
            return t.pin_memory().to(device, non_blocking=True)

        return Batch(copied(self.input_ids), copied(self.labels),
                     None if self.position_ids is None else copied(self.position_ids))

    def n_loss_tokens(self) -> int:
        return int(counted_tokens(self.labels))


class TokenWindows:
    """The windows of one split (train or val) of a prepared shard."""

    def __init__(self, prepared: Prepared, split: str, block_size: int) -> None:
        train = split == "train"
        start, end = (0, prepared.n_train) if train else (prepared.n_train, int(prepared.meta["tokens"]))
        self.tokens = prepared.tokens().view(start, end)
        mask = prepared.mask()
        self.mask = mask.view(start, end) if mask is not None else None
        self.block_size = block_size
        self.documents = bool(prepared.meta.get("documents"))
        # A window's last label is the next window's first token. Validation of masked data (chat) also reads the
        # last window, whose missing label is one the loss never counts (a conversation's first token), so every
        # conversation is evaluated; training keeps its count, which checkpoints record.
        whole = not train and self.mask is not None
        self.n_windows = max(0, (len(self.tokens) - (0 if whole else 1)) // block_size)

    def window(self, i: int) -> tuple[np.ndarray, np.ndarray | None]:
        a = i * self.block_size
        seq = self.tokens[a : a + self.block_size + 1]
        mask = self.mask[a : a + self.block_size + 1] if self.mask is not None else None
        if len(seq) == self.block_size and mask is not None:  # the last window of a split read whole
            seq, mask = np.append(seq, seq[-1:]), np.append(mask, np.zeros(1, mask.dtype))
        return seq, mask

    def batch(self, indices: list[int]) -> Batch:
        seqs, masks = zip(*(self.window(i) for i in indices), strict=True)
        x = torch.from_numpy(np.stack(seqs).astype(np.int64))
        inputs, labels = x[:, :-1], x[:, 1:].clone()
        positions = None
        if self.mask is not None:
            flags = torch.from_numpy(np.stack(masks).astype(np.uint8))
            labels[(flags[:, 1:] & IN_LOSS) == 0] = IGNORE_INDEX
            starts = (flags[:, :-1] & STARTS_SEQUENCE) != 0
            # a batch whose windows each hold one sequence is plain causal attention: no mask to build
            if self.documents and bool(starts[:, 1:].any()):
                positions = position_ids(starts)
        return Batch(inputs.contiguous(), labels.contiguous(), positions)


class TrainLoader:
    """Shuffled windows, epoch after epoch, addressed by a global sample cursor."""

    def __init__(
        self, windows: TokenWindows, batch_size: int, seed: int, rank: int = 0, world: int = 1
    ) -> None:
        if windows.n_windows == 0:
            raise ValueError("no training windows")
        self.windows = windows
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world = world
        self.cursor = 0  # samples consumed by all ranks together
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def _perm_for(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(self.windows.n_windows, generator=g).numpy()
            self._perm_epoch = epoch
        return self._perm

    def sample_index(self, s: int) -> int:
        epoch, pos = divmod(s, self.windows.n_windows)
        return int(self._perm_for(epoch)[pos])

    @property
    def epoch(self) -> float:
        return self.cursor / self.windows.n_windows

    def next_batch(self) -> Batch:
        first = self.cursor + self.rank * self.batch_size
        indices = [self.sample_index(s) for s in range(first, first + self.batch_size)]
        self.cursor += self.world * self.batch_size
        return self.windows.batch(indices)

    def state_dict(self) -> dict[str, int]:
        return {"cursor": self.cursor, "seed": self.seed, "n_windows": self.windows.n_windows,
                "block_size": self.windows.block_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["n_windows"] != self.windows.n_windows or state["block_size"] != self.windows.block_size:
            raise ValueError(
                "the data changed since the checkpoint "
                f"({state['n_windows']} windows of {state['block_size']} "
                f"then, {self.windows.n_windows} of {self.windows.block_size} now)"
            )
        self.cursor = int(state["cursor"])

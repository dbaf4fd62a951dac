"""Checkpoint save/load speed against a raw sequential write/read of the same bytes on the same disk.

A GPT-2-small-sized model (124M parameters) with its AdamW state, saved with kubetrain's checkpoint.save
(safetensors + trainer.pt + checksums + fsync + atomic rename) and loaded back with verification, interleaved
with `write + fsync` and `read` of one file of the same size. Usage:

    .venv/bin/python bench/bench_checkpoint.py [--dir DIR] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kubetrain import checkpoint
from kubetrain.config.schema import TrainConfig
from kubetrain.models.gpt import GPT, GPTConfig
from kubetrain.train.optim import build_optimizer


def gpt2_small() -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768, mlp_hidden=2048))
    opt = build_optimizer(model, TrainConfig(), torch.device("cpu"))
    x = torch.randint(0, 50304, (1, 8))
    model(x).float().mean().backward()
    opt.step()  # materialise exp_avg / exp_avg_sq
    return model.state_dict(), {"optimizer": opt.state_dict(), "state": {"step": 1}}


def raw_write(path: Path, nbytes: int, block: bytes) -> float:
    t = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            n = min(left, len(block))
            f.write(block[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t


def raw_read(path: Path) -> float:
    t = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(16 << 20):
            pass
    return time.perf_counter() - t


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None, help="Folder on the disk to measure (default: a temp folder).")
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp(dir=args.dir, prefix="kt-bench-ckpt-"))
    model_state, trainer_state = gpt2_small()
    n_params = sum(t.numel() for t in checkpoint.unique_tensors(model_state).values())
    block = os.urandom(16 << 20)
    # the tensor bytes of a checkpoint (its files add a few KB of headers): what the raw write writes
    raw_bytes = sum(t.numel() * t.element_size() for t in checkpoint.unique_tensors(model_state).values()) \
        + sum(v.numel() * v.element_size() for st in trainer_state["optimizer"]["state"].values()  # type: ignore[index]
              for v in st.values() if isinstance(v, torch.Tensor))
    saves, loads, writes, reads = [], [], [], []
    try:
        for r in range(args.rounds):
            root = folder / f"ckpts{r}"
            # Each timed write starts with nothing dirty in the page cache, so it pays for its own bytes only;
            # the order alternates so neither side always follows the other's writeback.
            for first in ((True, False) if r % 2 == 0 else (False, True)):
                os.sync()
                if first:
                    t = time.perf_counter()
                    ck = checkpoint.save(root, 1, model_state, trainer_state, {"bench": True}, keep_last=1)
                    saves.append(time.perf_counter() - t)
                else:
                    writes.append(raw_write(folder / f"raw{r}.bin", raw_bytes, block))
            nbytes = sum(info["bytes"] for info in ck.meta["files"].values())
            cold = drop_caches()
            t = time.perf_counter()
            loaded = checkpoint.verify(ck.path)
            loaded.model_state()
            loaded.trainer_state()
            loads.append(time.perf_counter() - t)
            drop_caches()
            reads.append(raw_read(folder / f"raw{r}.bin"))
            # Both sides write fresh files; freeing the old ones happens here, outside the timings.
            shutil.rmtree(root)
            (folder / f"raw{r}.bin").unlink()
            os.sync()
        gb = nbytes / 1e9
        s, w, ld, rd = (statistics.median(x) for x in (saves, writes, loads, reads))
        print(f"checkpoint of {n_params / 1e6:.0f}M params + AdamW: {gb:.2f} GB, {args.rounds} rounds (median), "
              f"page cache dropped before reads: {cold}")
        paired_save = statistics.median(x / y for x, y in zip(writes, saves, strict=True))
        paired_load = statistics.median(x / y for x, y in zip(reads, loads, strict=True))
        print(f"save {gb / s:.2f} GB/s vs raw write+fsync {gb / w:.2f} GB/s -> ratio {w / s:.2f} "
              f"(median of per-round ratios {paired_save:.2f})")
        print(f"load {gb / ld:.2f} GB/s vs raw read {gb / rd:.2f} GB/s -> ratio {rd / ld:.2f} "
              f"(median of per-round ratios {paired_load:.2f})")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()

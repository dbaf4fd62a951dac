"""Checkpoint save/load speed against a raw sequential write/read of the same bytes on the same disk.

A GPT-2-small-sized model (124M parameters) with its AdamW state, saved with kubetrain's checkpoint.save
(safetensors + trainer.pt + checksums + fsync + atomic rename) and loaded back with verification, interleaved
with `write + fsync` and `read` of one file of the same size. Usage:

    .venv/bin/python bench/bench_checkpoint.py [--dir DIR] [--rounds 3]

With --store, object storage instead (checkpoint.uri), against a SeaweedFS S3 server started here as a process:
upload and download of the same checkpoint by kubetrain (kubetrain.checkpoint.remote: files, meta.json,
pointers, retention; download with checksum verification and fsync) interleaved with s3fs's own recursive
`put`/`get` of the same folder; then training-step time of the same model while the background uploader
sends a checkpoint, against the intervals of the same run without an upload:

    .venv/bin/python bench/bench_checkpoint.py --store [--rounds 3] [--steps 200 --every 50 --context 128]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

from kubetrain import checkpoint
from kubetrain.checkpoint import remote
from kubetrain.checkpoint.store import Store, open_store
from kubetrain.config.schema import TrainConfig
from kubetrain.models.gpt import GPT, GPTConfig
from kubetrain.train.optim import build_optimizer

GPT2_SMALL = GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768, mlp_hidden=2048)


def gpt2_small() -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    torch.manual_seed(0)
    model = GPT(GPT2_SMALL)
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
    ap.add_argument("--store", action="store_true", help="Measure object storage (a SeaweedFS S3 server) instead.")
    ap.add_argument("--steps", type=int, default=200, help="--store: training steps for the step-time part.")
    ap.add_argument("--every", type=int, default=50, help="--store: a checkpoint every this many steps.")
    ap.add_argument("--context", type=int, default=128, help="--store: tokens per training sequence (batch 1).")
    ap.add_argument("--threads", type=int, default=1, help="--store: torch threads for the training steps.")
    args = ap.parse_args()
    if args.store:
        bench_store(args)
        return
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


def bench_store(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tests.object_store
    from tests.object_store import ADMIN, start_server

    os.environ.update(ADMIN)
    folder = Path(tempfile.mkdtemp(dir=args.dir, prefix="kt-bench-store-"))
    server = start_server(parent=folder)
    endpoint = server.url
    try:
        bucket = f"kt-bench-{uuid.uuid4().hex[:8]}"
        store = open_store(f"s3://{bucket}/ours", endpoint)
        store.fs.mkdir(bucket)
        transfer_rates(args, folder, store, bucket)
        step_times(args, folder, store)
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


def transfer_rates(args: argparse.Namespace, folder: Path, store: Store, bucket: str) -> None:
    model_state, trainer_state = gpt2_small()
    ck = checkpoint.save(folder / "local", 1, model_state, trainer_state, {"bench": True}, keep_last=1)
    del model_state, trainer_state
    nbytes = sum(info["bytes"] for info in ck.meta["files"].values())
    fs = store.fs
    ups, puts, downs, gets = [], [], [], []
    for r in range(args.rounds):
        name, raw = checkpoint.step_name(r + 1), f"{bucket}/raw/r{r}"
        for ours in ((True, False) if r % 2 == 0 else (False, True)):
            t = time.perf_counter()
            if ours:
                remote.upload(store, ck.path, name, is_best=False, keep_last=1000)
                ups.append(time.perf_counter() - t)
            else:
                fs.put(str(ck.path), raw, recursive=True)
                puts.append(time.perf_counter() - t)
        listing = store.sizes()
        for ours in ((False, True) if r % 2 == 0 else (True, False)):
            dest = folder / f"down{r}-{ours}"
            dest.mkdir()
            os.sync()
            t = time.perf_counter()
            if ours:
                remote.download(store, name, listing, dest)
                downs.append(time.perf_counter() - t)
            else:
                fs.get(raw, str(dest / "raw"), recursive=True)
                gets.append(time.perf_counter() - t)
            shutil.rmtree(dest)
        store.remove(name)  # free the objects outside the timings
        fs.rm(raw, recursive=True)
    gb = nbytes / 1e9
    u, p, d, g = (statistics.median(x) for x in (ups, puts, downs, gets))
    print(f"object storage (SeaweedFS, s3fs over HTTP): checkpoint of {gb:.2f} GB, {args.rounds} rounds (median)")
    print(f"upload   {gb / u:.3f} GB/s vs s3fs put {gb / p:.3f} GB/s -> ratio {p / u:.2f} "
          f"(median of per-round ratios {statistics.median(x / y for x, y in zip(puts, ups, strict=True)):.2f})")
    print(f"download {gb / d:.3f} GB/s vs s3fs get {gb / g:.3f} GB/s -> ratio {g / d:.2f} "
          f"(median of per-round ratios {statistics.median(x / y for x, y in zip(gets, downs, strict=True)):.2f}; "
          "ours verifies xxh3 checksums and fsyncs)")


def step_times(args: argparse.Namespace, folder: Path, store: Store) -> None:
    """One training run; after every other checkpoint the uploader sends it while the steps go on."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = GPT(GPT2_SMALL)
    opt = build_optimizer(model, TrainConfig(), torch.device("cpu"))
    root = folder / "run" / "checkpoints"
    uploader = remote.Uploader(store.child("train"), root, keep_last=2, log=print)
    x = torch.randint(0, GPT2_SMALL.vocab_size, (1, args.context + 1))
    quiet: list[float] = []
    busy: list[float] = []
    uploading = False
    for step in range(1, args.steps + 1):
        t = time.perf_counter()
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step > 5:  # the first steps warm up allocators and caches
            (busy if uploading else quiet).append(time.perf_counter() - t)
        if step % args.every == 0 and step < args.steps:
            saved = checkpoint.save(root, step, model.state_dict(), {"optimizer": opt.state_dict()}, {},
                                    keep_last=2)
            uploading = (step // args.every) % 2 == 1
            if uploading:
                uploader.submit(saved)
    t = time.perf_counter()
    uploader.close()
    q, b = statistics.mean(quiet), statistics.mean(busy)
    print(f"training steps (gpt2-124m shape, 1 x {args.context} tokens, {args.threads} thread(s), a checkpoint "
          f"every {args.every} steps, {args.steps} steps): mean {q * 1e3:.0f} ms/step in intervals without an "
          f"upload ({len(quiet)} steps), {b * 1e3:.0f} ms/step in intervals with one ({len(busy)} steps) -> "
          f"{100 * (b / q - 1):+.1f}%; median {statistics.median(quiet) * 1e3:.0f} vs "
          f"{statistics.median(busy) * 1e3:.0f} ms; waited {time.perf_counter() - t:.1f}s for the last upload")


if __name__ == "__main__":
    main()

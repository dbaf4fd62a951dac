"""How long training stops for a checkpoint: checkpoint.async_save against a synchronous save, in the real loop.

Two runs of the gpt2-124m preset (124M parameters + AdamW: 1.5 GB per checkpoint) through `kubetrain train`,
one with `checkpoint.async_save=false` and one with `true`, with the same shortened context and steps so it
fits a laptop CPU. Each checkpoint line in metrics.jsonl carries `blocked_seconds` (the loop was stopped) and
`write_seconds` (staging to the last fsync); the result is the async run's median blocked time over the sync
run's median save time (the target: <= 0.20 in one process, <= 0.25 under FSDP), plus each
run's wall time. `--fsdp N`: the same under FSDP on N local processes (each rank's shards of the model and
optimizer copied and written by its saver's thread, sharded.ShardSaver; rank 0's lines). Usage:

    .venv/bin/python bench/bench_async_checkpoint.py [--steps 5 --every 2 --context 128] [--fsdp 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def run(folder: Path, name: str, async_save: bool, args: argparse.Namespace) -> dict[str, object]:
    sets = [f"run.name={name}", f"run.output_dir={folder}/runs", f"data.cache_dir={folder}/cache",
            f"train.max_steps={args.steps}", f"checkpoint.every_steps={args.every}", "checkpoint.keep_last=2",
            f"checkpoint.async_save={str(async_save).lower()}", f"model.block_size={args.context}",
            "train.micro_batch_size=1", "train.grad_accum_steps=1", "train.compile=false", "run.device=cpu",
            "eval.every_steps=100000", "eval.windows=1", "eval.sample_prompt=null", "eval.sample_tokens=1",
            f"run.threads={args.threads}",
            "train.log_every_steps=1"]
    cmd = [sys.executable, "-m", "kubetrain", "train", "--preset", "gpt2-124m"]
    if args.fsdp:
        sets.append("dist.strategy=fsdp")
        cmd += ["--nproc", str(args.fsdp)]
    for item in sets:
        cmd += ["--set", item]
    t = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    wall = time.perf_counter() - t
    records = [json.loads(line) for line in (folder / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    ckpts = [r for r in records if r["kind"] == "checkpoint"]
    # the final save is waited for before the run ends either way: compare the periodic ones
    periodic = [r for r in ckpts if r["step"] < args.steps]
    return {"async_save": async_save, "wall_seconds": round(wall, 2),
            "blocked_seconds": [r["blocked_seconds"] for r in periodic],
            "write_seconds": [r["write_seconds"] for r in periodic]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fsdp", type=int, default=0, help="Ranks of an FSDP run (0: one process).")
    ap.add_argument("--dir", default=None, help="Folder on the disk to measure (default: a temp folder).")
    ap.add_argument("--out", default=None, help="Write the result JSON into this folder.")
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp(dir=args.dir, prefix="kt-bench-async-"))
    try:
        sync = run(folder, "sync", False, args)
        shutil.rmtree(folder / "runs" / "sync")
        asynchronous = run(folder, "async", True, args)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    sync_save = statistics.median(sync["blocked_seconds"])  # type: ignore[arg-type]
    async_blocked = statistics.median(asynchronous["blocked_seconds"])  # type: ignore[arg-type]
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "bench": "bench/bench_async_checkpoint.py", "commit": sha, "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__, "cpus": os.cpu_count(), "machine": platform.processor() or platform.machine(),
        "model": "gpt2-124m preset (124M params + AdamW)" + (f", FSDP on {args.fsdp} ranks" if args.fsdp else ""),
        "args": vars(args),
        "sync": sync, "async": asynchronous,
        "sync_save_seconds_median": sync_save, "async_blocked_seconds_median": async_blocked,
        "blocked_ratio": round(async_blocked / sync_save, 4),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        kind = f"async-checkpoint-fsdp{args.fsdp}" if args.fsdp else "async-checkpoint"
        out = Path(args.out) / f"{kind}-gpt2-124m_cpu-{os.cpu_count()}core_{time.strftime('%Y-%m-%d')}.json"
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()

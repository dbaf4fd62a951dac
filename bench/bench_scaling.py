"""Data-parallel scaling on this CPU: 2 processes x 1 thread (DDP, gloo) against 1 process x 2 threads.

Both train the same model with the same global batch through the real loop (`kubetrain train`), rounds
interleaved; throughput is the median of the logged tokens/s windows after the first (warm-up) one.

    .venv/bin/python bench/bench_scaling.py [--rounds 3] [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SHAPE = ["model.n_layer=6", "model.n_head=6", "model.n_embd=384", "model.block_size=256", "train.log_every_steps=5",
         "eval.every_steps=100000", "checkpoint.every_steps=100000", "eval.sample_prompt=null"]


def run(cwd: Path, name: str, steps: int, nproc: int, threads: int, global_batch: int) -> float:
    sets = [*SHAPE, f"run.name={name}", f"train.max_steps={steps}", f"run.threads={threads}",
            f"train.micro_batch_size={global_batch // nproc}", f"data.cache_dir={cwd / 'cache'}"]
    cmd = [sys.executable, "-m", "kubetrain", "train", *[x for s in sets for x in ("--set", s)]]
    if nproc > 1:
        cmd += ["--nproc", str(nproc)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    subprocess.run(cmd, cwd=cwd, env=env, check=True, capture_output=True, text=True)
    return median_rate(cwd / "runs" / name)


def median_rate(run_dir: Path) -> float:
    """The median of a run's logged tokens/s windows after the first (warm-up) one."""
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_second"] for r in records if r["kind"] == "train"][1:]
    return statistics.median(rates)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--global-batch", type=int, default=8)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kt-bench-scaling-") as tmp:
        cwd = Path(tmp)
        one, two = [], []
        for r in range(args.rounds):
            order = [(1, 2), (2, 1)] if r % 2 == 0 else [(2, 1), (1, 2)]
            for nproc, threads in order:
                rate = run(cwd, f"p{nproc}r{r}", args.steps, nproc, threads, args.global_batch)
                (one if nproc == 1 else two).append(rate)
        a, b = statistics.median(one), statistics.median(two)
        print(f"GPT 6x384, context 256, vocab 256, global batch {args.global_batch}, {args.steps} steps, "
              f"{args.rounds} rounds (median)")
        print(f"1 process x 2 threads: {a:,.0f} tok/s")
        print(f"2 processes x 1 thread (DDP, gloo): {b:,.0f} tok/s")
        print(f"ratio 2x1 / 1x2 = {b / a:.2f}")


if __name__ == "__main__":
    main()

"""The training spine before and after a change: the same config through `kubetrain train` of two source trees.

Compares this checkout's Trainer with the training loop of an earlier commit (default: 9fb8881, the last commit
before the Trainer redesign), rounds interleaved so that load on the machine falls on both alike. Throughput is
the median of the logged tokens/s windows after the first (warm-up) one; the ratio is new/old.

    .venv/bin/python bench/bench_trainer.py [--base 9fb8881] [--rounds 3] [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_scaling import median_rate  # bench/ is the script's folder, first on sys.path

ROOT = Path(__file__).resolve().parents[1]
SHAPE = ["model.n_layer=6", "model.n_head=6", "model.n_embd=384", "model.block_size=256", "train.log_every_steps=5",
         "train.micro_batch_size=4", "eval.every_steps=100000", "checkpoint.every_steps=100000",
         "eval.sample_prompt=null", "run.threads=2"]


def run(src: Path, cwd: Path, name: str, steps: int) -> float:
    sets = [*SHAPE, f"run.name={name}", f"train.max_steps={steps}", f"data.cache_dir={cwd / 'cache'}"]
    cmd = [sys.executable, "-m", "kubetrain", "train", *[x for s in sets for x in ("--set", s)]]
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "2"}
    subprocess.run(cmd, cwd=cwd, env=env, check=True, capture_output=True, text=True)
    return median_rate(cwd / "runs" / name)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="9fb8881")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "old"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(old), args.base], check=True)
        try:
            rates: dict[str, list[float]] = {"old": [], "new": []}
            for i in range(args.rounds):
                for label, src in (("old", old / "src"), ("new", ROOT / "src")):
                    rates[label].append(run(src, Path(tmp), f"{label}{i}", args.steps))
                    print(f"round {i} {label}: {rates[label][-1]:,.0f} tokens/s", flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=True)
    best = {k: max(v) for k, v in rates.items()}
    print(json.dumps({"base": args.base, "shape": SHAPE, "steps": args.steps, "tokens_per_second": rates,
                      "best": best, "ratio_new_over_old": best["new"] / best["old"]}))


if __name__ == "__main__":
    main()

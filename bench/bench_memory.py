"""Peak memory per process of training one GPT with one process, DDP and FSDP at 2 and 4 gloo ranks, with and
without gradient checkpointing, through the real loop (`kubetrain train`).

The figure is the peak resident set of the largest process of a run: ru_maxrss of RUSAGE_CHILDREN, read by a
small wrapper process after `kubetrain train` (and its elastic agent's workers) ended. Each run trains a few
steps with a checkpoint every `--every` steps (2: in the background, as configured by default) and at the end.
Under FSDP every rank writes its own DCP shards of the model and optimizer; nothing is gathered.
The baseline is one process that imported kubetrain's trainer, torch, FSDP and DCP, and nothing else; ratios
are given of the peaks and of the growth over that baseline (what the model and its training add).

    PYTHONPATH=src .venv/bin/python bench/bench_memory.py [--layers 12 --width 768 --context 256] [--out auto]
        [--only ddp4,fsdp4]   (FSDP's largest process over DDP's, 4 ranks: the figure FSDP is held to)

The default shape is GPT-2 small's blocks with a byte vocabulary: 85M parameters. 4 ranks under DDP take ~10 GB
of RAM together: run it alone.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# Runs `kubetrain train ...` and prints the peak RSS (KiB) of its largest descendant that was waited for.
MEASURE = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
           "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)")
BASELINE = ("import resource, kubetrain.train.trainer, torch.distributed.fsdp, torch.distributed.checkpoint; "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")


def settings(args: argparse.Namespace, cwd: Path) -> list[str]:
    return [f"model.n_layer={args.layers}", f"model.n_head={args.width // 64}", f"model.n_embd={args.width}",
            f"model.block_size={args.context}", f"train.micro_batch_size={args.batch}", f"train.max_steps={args.steps}",
            "train.warmup_steps=0", "train.log_every_steps=1", "eval.every_steps=100000", "eval.windows=1",
            "eval.sample_prompt=null", f"checkpoint.every_steps={args.every}", "checkpoint.keep_last=1",
            "run.threads=1",
            f"data.sources=[{{kind: text, path: {cwd / 'corpus.txt'}}}]", f"data.cache_dir={cwd / 'cache'}",
            "track.console=false"]


def peak_mib(cmd: list[str], cwd: Path) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, "-c", MEASURE, *cmd], cwd=cwd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[-4:])} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return int(out.stdout.strip().splitlines()[-1]) / 1024


def measure(args: argparse.Namespace, cwd: Path) -> dict[str, Any]:
    base = [sys.executable, "-m", "kubetrain", "train"]
    rows = []
    for checkpointing in (False, True):
        for strategy, nproc in (("single", 1), ("ddp", 2), ("fsdp", 2), ("ddp", 4), ("fsdp", 4)):
            name = f"{strategy}{nproc}{'-ac' if checkpointing else ''}"
            if args.only and name not in args.only.split(","):
                continue
            sets = [*settings(args, cwd), f"run.name={name}", f"dist.strategy={'ddp' if strategy == 'ddp' else 'fsdp'}",
                    f"model.gradient_checkpointing={str(checkpointing).lower()}"]
            cmd = [*base, *[x for s in sets for x in ("--set", s)], *(["--nproc", str(nproc)] if nproc > 1 else [])]
            mib = peak_mib(cmd, cwd)
            rows.append({"strategy": strategy, "ranks": nproc, "gradient_checkpointing": checkpointing,
                         "peak_rss_mib": round(mib, 1)})
            print(f"{name:10s} peak RSS of the largest process: {mib:8.1f} MiB", flush=True)
    return {"runs": rows}


def ratios(rows: list[dict[str, Any]], base: float = 0.0) -> dict[str, float]:
    """FSDP / DDP and FSDP / one process, per rank count and checkpointing (of the peaks less `base`)."""
    peak = {(r["strategy"], r["ranks"], r["gradient_checkpointing"]): r["peak_rss_mib"] - base for r in rows}
    pairs = {}
    for ac in (False, True):
        tag = "-ac" if ac else ""
        for n in (2, 4):
            pairs[f"fsdp{n}/ddp{n}{tag}"] = (("fsdp", n, ac), ("ddp", n, ac))
            pairs[f"fsdp{n}/single{tag}"] = (("fsdp", n, ac), ("single", 1, ac))
    pairs["ac/no-ac single"] = (("single", 1, True), ("single", 1, False))
    return {name: round(peak[a] / peak[b], 3) for name, (a, b) in pairs.items() if a in peak and b in peak}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--every", type=int, default=2, help="Steps between checkpoints (and one at the end).")
    ap.add_argument("--only", default=None, help="Runs to measure, e.g. ddp4,fsdp4 (default: all ten).")
    ap.add_argument("--out", default=None, help="a JSON file, or 'auto': bench/results/memory-<shape>_<hw>_<date>.json")
    args = ap.parse_args()
    import torch

    from kubetrain.config.schema import ModelConfig
    from kubetrain.models import build_model

    with torch.device("meta"):
        cfg = ModelConfig(n_layer=args.layers, n_head=args.width // 64, n_embd=args.width, block_size=args.context)
        params = sum(p.numel() for p in build_model(cfg, 256).parameters())
    with tempfile.TemporaryDirectory(prefix="kt-bench-memory-") as tmp:
        cwd = Path(tmp)
        words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "memory", "grows"]
        (cwd / "corpus.txt").write_text(" ".join(words[(i * 7) % len(words)] for i in range(400_000)))
        baseline = subprocess.run([sys.executable, "-c", BASELINE], capture_output=True, text=True, check=True,
                                  env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
        load_before = os.getloadavg()
        result = measure(args, cwd)
    base = round(int(baseline.stdout.strip()) / 1024, 1)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout
    report = {
        "what": "peak RSS of the largest process, kubetrain train (gloo, CPU, 1 thread per process)",
        "model": {"params": params, "layers": args.layers, "width": args.width, "context": args.context,
                  "vocab": 256, "micro_batch": args.batch, "steps": args.steps, "checkpoint_every": args.every},
        "baseline_mib": base,
        **result, "ratios": ratios(result["runs"]), "ratios_over_baseline": ratios(result["runs"], base),
        "commit": commit.strip() + ("-dirty" if dirty.strip() else ""), "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "load_before": load_before, "load_after": os.getloadavg(),
        "date": datetime.date.today().isoformat(),
    }
    print(f"baseline (imports only): {base} MiB")
    for key, value in report["ratios"].items():
        print(f"{key:22s} {value:.3f}   over the baseline: {report['ratios_over_baseline'][key]:.3f}")
    if args.out:
        path = Path(args.out) if args.out != "auto" else ROOT / "bench" / "results" / (
            f"memory-gpt-{args.layers}x{args.width}_cpu-{os.cpu_count()}core_{report['date']}.json")
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"written: {path}")


if __name__ == "__main__":
    main()

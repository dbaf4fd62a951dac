"""The trainer against a bare loop of the same model and loss, eager and compiled, on this machine's device.

What the next GPU run measures, in one process: `kubetrain train` on the gpt2-124m shape (bf16,
micro-batch 16, context 1024) with `train.compile` false and true, each against the least loop that trains the same
model (its model and loss compiled together, its optimizer, autocast and clipping, one batch already on the
device), plus doctor's memory estimate of each run. Tokens/s is the median of the windows after the first; peak
memory is torch.cuda.max_memory_allocated. Ratios are trainer / bare loop and estimate / measured.

    .venv/bin/python bench/bench_gpu_step.py --out auto           # a GPU: writes bench/results/...json
    .venv/bin/python bench/bench_gpu_step.py --quick              # the CPU: a tiny shape, to see it run
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from provenance import commit, save


def measure(quick: bool) -> dict[str, Any]:
    from kubetrain.doctor import doctor
    from kubetrain.selftest.context import Context
    from kubetrain.selftest.speed import _kubetrain_speed, bare_loop_speed, speed_config

    device = "cuda" if torch.cuda.is_available() else "cpu"
    report: dict[str, Any] = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                              "torch": torch.__version__, "commit": commit(), "quick": quick,
                              "date": datetime.date.today().isoformat()}
    with tempfile.TemporaryDirectory() as tmp:
        ctx = Context(device=device, quick=quick, work=Path(tmp))
        for compiled in (False, True) if device == "cuda" else (False,):  # Inductor's C++ takes minutes here
            mode = "compiled" if compiled else "eager"
            estimate = doctor(speed_config(ctx, compiled))["fit"]["estimate"]
            trainer = _kubetrain_speed(ctx, compiled)
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            bare = bare_loop_speed(ctx, compiled)
            peak = trainer["peak_gib"] * 2**30
            report[mode] = {"trainer": trainer, "bare_loop": bare, "estimate_bytes": estimate,
                            "speed_ratio": trainer["tokens_per_second"] / bare["tokens_per_second"],
                            "memory_ratio": trainer["peak_gib"] / bare["peak_gib"] if bare["peak_gib"] else None,
                            "estimate_over_measured": estimate / peak if device == "cuda" and estimate else None}
            print(f"{mode}: trainer {trainer['tokens_per_second']:,.0f} tok/s, bare loop "
                  f"{bare['tokens_per_second']:,.0f} tok/s, ratio {report[mode]['speed_ratio']:.3f}", flush=True)
    return report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a tiny shape (the default on the CPU)")
    ap.add_argument("--out", help="a file, or auto: bench/results/gpu-step-gpt2-124m_<device>_<date>.json")
    args = ap.parse_args()
    report = measure(args.quick or not torch.cuda.is_available())
    if args.out:
        out = save(report, args.out, f"gpu-step-gpt2-124m_{report['device'].lower().replace(' ', '-')}")
        print(f"wrote {out}", file=sys.stderr)
    else:
        print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

"""Correctness: the device agrees with the CPU, mixed precision stays close to fp32, a resume is exact."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubetrain.selftest import Outcome, judged, skipped
from kubetrain.selftest.context import Context, config, kubetrain, last_line, losses, max_abs_diff, records, sets, train
from kubetrain.selftest.context import overrides as run_overrides

CPU_TOLERANCE = 5e-3  # fp32 on both, TF32 off: only the order of the reductions differs
MIXED_TOLERANCE = 0.1  # bf16/fp16 autocast against fp32, per step, in nats


def steps(ctx: Context) -> int:
    return 12 if ctx.quick else 40


_curves: dict[str, list[float]] = {}  # fp32 curve of the device, trained once and compared by several items


def _curve(ctx: Context, device: str, precision: str) -> list[float]:
    key = f"{device}-{precision}"
    if key not in _curves:
        cfg = config(ctx, f"correct-{key}", f"run.device={device}", f"train.precision={precision}",
                     "train.tf32=false", "train.deterministic=true", f"train.max_steps={steps(ctx)}")
        _curves[key] = losses(train(cfg)[1])
    return _curves[key]


def cpu_match(ctx: Context) -> Outcome:
    name = "correctness.cpu_match"
    if ctx.device == "cpu":
        return skipped(name, "the device is the CPU: there is no second device to compare it with")
    device, cpu = _curve(ctx, ctx.device, "fp32"), _curve(ctx, "cpu", "fp32")
    diff = max_abs_diff(device, cpu)
    return judged(name, diff <= CPU_TOLERANCE,
                  f"a 2-layer GPT, {len(cpu)} steps from one seed in fp32 (TF32 off) on {ctx.device} and on the CPU",
                  {"max_abs_loss_diff": diff, "final_loss_device": device[-1], "final_loss_cpu": cpu[-1]},
                  f"max |loss difference| <= {CPU_TOLERANCE}")


def mixed(precision: str) -> Callable[[Context], Outcome]:
    name = f"correctness.{precision}"

    def check(ctx: Context) -> Outcome:
        if precision == "fp16" and not ctx.on_gpu:
            return skipped(name, "fp16 trains with a loss scaler, which needs a CUDA GPU (the CPU trains bf16 or fp32)")
        from kubetrain import hardware
        from kubetrain.train.device import select_device

        if precision == "bf16" and not hardware.bf16_supported(select_device(ctx.device)):
            return skipped(name, f"bf16 does not run on this {ctx.device}")
        full, low = _curve(ctx, ctx.device, "fp32"), _curve(ctx, ctx.device, precision)
        diff = max_abs_diff(full, low)
        scaler = " with its loss scaler" if precision == "fp16" else " autocast"
        return judged(name, diff <= MIXED_TOLERANCE,
                      f"{len(low)} steps in {precision}{scaler} against fp32 from one seed on {ctx.device}",
                      {"max_abs_loss_diff": diff, f"final_loss_{precision}": low[-1], "final_loss_fp32": full[-1]},
                      f"max |loss difference| <= {MIXED_TOLERANCE} per step")

    return check


def resume(ctx: Context) -> Outcome:
    """Train N steps in one go; in a new process, resume the same run's step-N/2 checkpoint and train to N."""
    name = "correctness.resume"
    n = steps(ctx) // 2 * 2
    k = n // 2
    common = ["train.deterministic=true", f"train.max_steps={n}", f"checkpoint.every_steps={k}",
              "checkpoint.keep_last=10", f"eval.every_steps={k}"]
    whole, whole_rows = train(config(ctx, "resume-whole", *common))
    start = Path(whole.run_dir) / "checkpoints" / f"step-{k:06d}"
    proc = kubetrain("train", *sets(run_overrides(ctx, "resume-split", *common)), "--resume", str(start), "--json",
                     timeout=600)
    if proc.returncode != 0:
        return Outcome(name, "failed", f"the resumed run exited {proc.returncode}: {last_line(proc.stderr)}")
    split = json.loads(last_line(proc.stdout))
    split_rows = records(Path(split["run_dir"]))
    after = [r for r in whole_rows if r["step"] > k]
    order = [(r["step"], r["tokens"], r["epoch"]) for r in after] == [(r["step"], r["tokens"], r["epoch"])
                                                                     for r in split_rows]
    bitwise = losses(after) == losses(split_rows)
    weights = [_checksum(Path(run) / "checkpoints" / f"step-{n:06d}") for run in (whole.run_dir, split["run_dir"])]
    figures: dict[str, Any] = {
        "steps": n, "resumed_at": k, "resumed_from": split.get("resumed_from"), "same_data_order": order,
        "bitwise_losses": bitwise, "same_final_weights": weights[0] == weights[1],
        "max_abs_loss_diff": max_abs_diff(losses(after), losses(split_rows)) if len(after) == len(split_rows)
        else None}
    ok = split.get("resumed_from") == k and order and bitwise and weights[0] == weights[1]
    return judged(name, ok, f"{n} steps in one process against a new process resuming the step-{k} checkpoint, "
                  "train.deterministic: true", figures,
                  "the same tokens at every step, bitwise equal losses and final weights (xxh3 of model.safetensors)")


def _checksum(checkpoint: Path) -> str:
    meta = json.loads((checkpoint / "meta.json").read_text())
    return str(meta["files"]["model.safetensors"]["xxh3_128"])


def prepare(ctx: Context) -> None:
    # cuBLAS reads its workspace setting when it makes its first handle: set it before any run of this process,
    # so the deterministic runs here and in the resuming process use the same one.
    if ctx.on_gpu:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


CHECKS: dict[str, Callable[[Context], Outcome]] = {
    "correctness.cpu_match": cpu_match,
    "correctness.bf16": mixed("bf16"),
    "correctness.fp16": mixed("fp16"),
    "correctness.resume": resume,
}

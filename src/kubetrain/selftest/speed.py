"""Speed: the gpt2-124m preset in bf16, eager and compiled (tokens/s, MFU against the device's peak, peak memory);
the trainer against a bare loop around the same model and loss (what the trainer's own overhead costs); and the
same shape through Hugging Face's GPT-2 (sdpa attention, compiled) in a loop that needs no kubetrain code."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

from kubetrain.config.schema import Config
from kubetrain.selftest import Outcome, judged, skipped
from kubetrain.selftest.context import Context, config, train

REFERENCE_RATIO = 0.5  # kubetrain's compiled step must reach at least half the reference's tokens/s
OVERHEAD_SPEED, OVERHEAD_MEMORY = 0.97, 1.05  # the trainer against a bare loop of the same model and loss
COMPILE_ON_CPU = ("torch.compile on the CPU builds C++ kernels for minutes (2m43s cold for a 2-layer GPT on a "
                  "2-core VM): the CPU check skips it; a GPU runs it")


def shape(ctx: Context) -> dict[str, int]:
    """The gpt2-124m preset's shape (micro-batch 16 of 1024 tokens), or a tiny one in quick mode."""
    if ctx.quick:
        return {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64, "vocab_size": 256, "batch": 4}
    return {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024, "vocab_size": 50304, "batch": 16}


def steps(ctx: Context) -> tuple[int, int]:
    """(optimizer steps, steps per logged window); the first window (warm-up, compilation) is not counted."""
    return (6, 2) if ctx.quick else (30, 5)


def precision(ctx: Context) -> str:
    return "bf16" if ctx.on_gpu or ctx.device == "cpu" else "fp32"


_results: dict[str, dict[str, Any]] = {}


def speed_config(ctx: Context, compiled: bool) -> Config:
    """The gpt2-124m shape (or quick's tiny one) as the speed checks train it."""
    s, (n, window) = shape(ctx), steps(ctx)
    key = "compiled" if compiled else "eager"
    return config(ctx, f"speed-{key}", "data.tokenizer.kind=byte", f"model.vocab_size={s['vocab_size']}",
                  f"model.n_layer={s['n_layer']}", f"model.n_head={s['n_head']}", f"model.n_embd={s['n_embd']}",
                  f"model.block_size={s['block_size']}", f"train.micro_batch_size={s['batch']}",
                  "train.grad_accum_steps=1", f"train.precision={precision(ctx)}", f"train.compile={compiled}",
                  f"train.max_steps={n}", f"train.log_every_steps={window}", preset="gpt2-124m", tiny=False)


def _kubetrain_speed(ctx: Context, compiled: bool) -> dict[str, Any]:
    """The trainer's run, once per process whichever check asks first (speed.compiled, .overhead, .reference)."""
    key = "compiled" if compiled else "eager"
    if key not in _results:
        s = shape(ctx)
        result, rows = train(speed_config(ctx, compiled))
        timed = rows[1:] or rows
        mfu = [r["mfu"] for r in timed if r.get("mfu") is not None]
        _results[key] = {"tokens_per_second": statistics.median(r["tokens_per_second"] for r in timed),
                         "mfu": statistics.median(mfu) if mfu else None, "final_loss": result.final_train_loss,
                         "steps": result.steps, "tokens_per_step": s["batch"] * s["block_size"],
                         # each log line's peak since the previous one (the allocator's on CUDA): the run's peak
                         "peak_gib": max(r["memory_gib"] for r in rows)}
    return _results[key]


def _describe(ctx: Context) -> str:
    s = shape(ctx)
    what = "a tiny shape (quick)" if ctx.quick else "the gpt2-124m preset"
    return (f"{what}: {s['n_layer']} layers x {s['n_embd']}, context {s['block_size']}, micro-batch {s['batch']}, "
            f"{precision(ctx)}, {steps(ctx)[0]} steps")


def kubetrain_speed(compiled: bool) -> Callable[[Context], Outcome]:
    name = "speed.compiled" if compiled else "speed.eager"

    def check(ctx: Context) -> Outcome:
        if compiled and ctx.device == "cpu":
            return skipped(name, COMPILE_ON_CPU)
        got = _kubetrain_speed(ctx, compiled)
        finite = got["final_loss"] is not None and math.isfinite(got["final_loss"])
        mfu = "" if got["mfu"] is not None else " (no MFU: this device has no entry in the peak-FLOPS table)"
        return judged(name, finite and got["tokens_per_second"] > 0,
                      f"{_describe(ctx)}, train.compile: {str(compiled).lower()}{mfu}", got,
                      "a finite loss; tokens/s is the median of the logged windows after the first")

    return check


def reference(ctx: Context) -> Outcome:
    name = "speed.reference"
    try:
        import transformers  # noqa: F401
    except ImportError:
        return skipped(name, "transformers is not installed (pip install 'kubetrain[hf]')")
    compiled = ctx.device != "cpu"
    ours = _kubetrain_speed(ctx, compiled)
    theirs = hf_gpt2_speed(ctx, compiled)
    ratio = ours["tokens_per_second"] / theirs["tokens_per_second"]
    figures = {"reference": theirs, "kubetrain_tokens_per_second": ours["tokens_per_second"], "ratio": ratio}
    mode = "compiled" if compiled else f"eager ({COMPILE_ON_CPU.split(':')[0]})"
    why = f"transformers' GPT2LMHeadModel (sdpa) of the same shape, {mode}, against kubetrain's, as a ratio"
    if ctx.quick:
        return judged(name, math.isfinite(ratio) and ratio > 0, why, figures,
                      "quick mode reports the ratio without judging it (tiny shapes time overheads, not kernels)")
    return judged(name, ratio >= REFERENCE_RATIO, why, figures, f"kubetrain / reference tokens/s >= {REFERENCE_RATIO}")


def bare_loop_speed(ctx: Context, compiled: bool) -> dict[str, Any]:
    """Tokens/s and peak memory of the least a training loop of kubetrain's model can do: its model and loss
    (compiled together as the trainer compiles them), its optimizer, autocast and gradient clipping, one batch
    already on the device, the loss never read. What the trainer adds to that is its overhead."""
    import torch

    from kubetrain.data.loader import counted_tokens
    from kubetrain.models import build_model
    from kubetrain.train.loss import loss_step
    from kubetrain.train.optim import build_optimizer

    cfg, s, (n, window) = speed_config(ctx, compiled), shape(ctx), steps(ctx)
    device = torch.device(ctx.device)
    torch.manual_seed(0)
    model = build_model(cfg.model, s["vocab_size"]).to(device).train()
    optimizer = build_optimizer(model, cfg.train, device)
    forward_loss = loss_step(model, compiled)
    data = torch.randint(0, s["vocab_size"], (s["batch"], s["block_size"] + 1), device=device)
    x, y = data[:, :-1], data[:, 1:].contiguous()
    dtype = torch.bfloat16 if precision(ctx) == "bf16" else torch.float32

    def step() -> None:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = forward_loss(x, y) / counted_tokens(y).clamp(min=1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    rate = _timed(step, device, n, window, s["batch"] * s["block_size"])
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"tokens_per_second": rate, "peak_gib": peak, "compiled": compiled}


def _timed(step: Callable[[], Any], device: Any, n: int, window: int, tokens_per_step: int) -> float:
    """The median tokens/s of the windows after a first one (compilation, autotuning, the allocator's first
    blocks); the device is synchronised at each window's end only. CUDA's peak memory counts from the start."""
    import torch

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(window):
        step()
    sync()
    rates = []
    for _ in range(max(1, (n - window) // window)):
        start = time.perf_counter()
        for _ in range(window):
            step()
        sync()
        rates.append(window * tokens_per_step / (time.perf_counter() - start))
    return statistics.median(rates)


def overhead(ctx: Context) -> Outcome:
    name = "speed.overhead"
    compiled = ctx.device != "cpu"
    ours, bare = _kubetrain_speed(ctx, compiled), bare_loop_speed(ctx, compiled)
    speed = ours["tokens_per_second"] / bare["tokens_per_second"]
    memory = ours["peak_gib"] / bare["peak_gib"] if bare["peak_gib"] else None
    figures = {"trainer": ours, "bare_loop": bare, "speed_ratio": speed, "memory_ratio": memory}
    mode = "compiled" if compiled else f"eager ({COMPILE_ON_CPU.split(':')[0]})"
    why = (f"{_describe(ctx)}, {mode}: `kubetrain train` against a bare loop of the same model, loss, optimizer "
           "and batch, already on the device")
    if ctx.quick or memory is None:
        return judged(name, math.isfinite(speed) and speed > 0, why, figures,
                      "reported, not judged: quick mode times overheads of tiny shapes, and a CPU has no "
                      "allocator peak to compare")
    return judged(name, speed >= OVERHEAD_SPEED and memory <= OVERHEAD_MEMORY, why, figures,
                  f"trainer / bare loop: tokens/s >= {OVERHEAD_SPEED}, peak memory <= {OVERHEAD_MEMORY}")


SDPA: dict[str, Any] = {"attn_implementation": "sdpa"}  # a config keyword of transformers' own, untyped there


def hf_gpt2_speed(ctx: Context, compiled: bool) -> dict[str, Any]:
    """Tokens/s of a plain training loop (AdamW, autocast, cross-entropy) around transformers' GPT-2."""
    import torch
    import torch.nn.functional as F
    from transformers import GPT2Config, GPT2LMHeadModel

    from kubetrain.train.device import model_flops_per_token, peak_flops

    s, (n, window) = shape(ctx), steps(ctx)
    device = torch.device(ctx.device)
    torch.manual_seed(0)
    hf = GPT2Config(vocab_size=s["vocab_size"], n_positions=s["block_size"], n_embd=s["n_embd"], n_layer=s["n_layer"],
                    n_head=s["n_head"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                    bos_token_id=None, eos_token_id=None, **SDPA)
    model: Any = GPT2LMHeadModel(hf)
    model.to(device).train()
    flops = model_flops_per_token(model, s["block_size"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=device.type == "cuda")
    forward = torch.compile(model) if compiled else model
    data = torch.randint(0, s["vocab_size"], (s["batch"], s["block_size"] + 1), device=device)
    x, y = data[:, :-1], data[:, 1:]
    dtype = torch.bfloat16 if precision(ctx) == "bf16" else torch.float32

    losses: list[float] = []

    def step() -> None:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            logits = forward(input_ids=x).logits
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))

    rate = _timed(step, device, n, window, s["batch"] * s["block_size"])
    peak = peak_flops(device, precision(ctx))
    return {"tokens_per_second": rate, "mfu": rate * flops / peak if peak else None, "final_loss": losses[-1],
            "compiled": compiled, "attention": model.config._attn_implementation}


CHECKS: dict[str, Callable[[Context], Outcome]] = {
    "speed.eager": kubetrain_speed(compiled=False),
    "speed.compiled": kubetrain_speed(compiled=True),
    "speed.overhead": overhead,
    "speed.reference": reference,
}

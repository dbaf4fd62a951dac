"""Training throughput of our GPT against Hugging Face GPT-2 of the same shape, and this CPU's matmul limit.

One optimizer step = forward + loss + backward + grad clip + AdamW: the training loop's inner step, with
its loss (kubetrain.train.loss.lm_loss) and optimizer (kubetrain.train.optim.build_optimizer) for both
models. Both run interleaved in one process, several rounds in alternating order; the median of the
rounds is compared. A large fp32 matmul, timed in the same rounds, is the CPU's practical peak, and both
models' MFU is reported against it (FLOPs per token: 6 x matmul weights + causal attention, same formula).

Each round is timed twice: wall clock, and this process's CPU time. On a machine that others share, CPU
time is the steadier measure (with one thread it is what an idle core would take); both are reported.

    PYTHONPATH=src python bench/bench_gpt.py --threads 1 --out auto
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
from provenance import commit
from torch import nn

from kubetrain.config.schema import TrainConfig
from kubetrain.models.gpt import GPT, GPTConfig
from kubetrain.models.loss import lm_loss
from kubetrain.train.optim import build_optimizer

ROOT = Path(__file__).resolve().parents[1]
Timer = Callable[[int], tuple[float, float]]  # run n times -> (wall seconds, CPU seconds)
Forward = Callable[[torch.Tensor], torch.Tensor]


def ours(a: argparse.Namespace) -> tuple[nn.Module, Forward, float]:
    model = GPT(GPTConfig(vocab_size=a.vocab, block_size=a.context, n_layer=a.layers, n_head=a.heads,
                          n_embd=a.width))
    return model, model, model.flops_per_token()


def hf_gpt2(a: argparse.Namespace) -> tuple[nn.Module, Forward, float]:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=a.vocab, n_positions=a.context, n_embd=a.width, n_layer=a.layers,
                     n_head=a.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                     tie_word_embeddings=True, bos_token_id=None, eos_token_id=None)
    model = GPT2LMHeadModel(cfg)

    def forward(ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids).logits

    # GPT.flops_per_token's formula: 6 x every matmul weight (blocks + lm_head) + causal attention.
    c = a.width
    per_layer = 3 * c * c + c * c + 4 * c * c + 4 * c * c  # c_attn, attn c_proj, c_fc (4x MLP), mlp c_proj
    flops = 6.0 * (a.layers * per_layer + a.vocab * c) + 12.0 * a.layers * c * a.context
    return model, forward, flops


def clocked(body: Callable[[], None]) -> Timer:
    def run(n: int) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(n):
            body()
        return time.perf_counter() - wall, time.process_time() - cpu

    return run


def train_step(model: nn.Module, forward: Forward, a: argparse.Namespace) -> Timer:
    model.train()
    opt = build_optimizer(model, TrainConfig(lr=1e-4, weight_decay=0.1), torch.device("cpu"))
    x = torch.randint(0, a.vocab, (a.batch, a.context + 1), generator=torch.Generator().manual_seed(0))
    inputs, labels = x[:, :-1].contiguous(), x[:, 1:].contiguous()

    def step() -> None:
        lm_loss(forward(inputs), labels).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return clocked(step)


def matmul(n: int) -> Timer:
    a, b, out = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)

    def product() -> None:
        torch.mm(a, b, out=out)

    return clocked(product)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def summary(name: str, tps: float, flops: float, peak: float, params: int) -> dict[str, float]:
    return {"tokens_per_second": tps, "gflops": tps * flops / 1e9, "mfu": tps * flops / peak,
            "flops_per_token": flops, "params": params}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in [("layers", 6), ("width", 384), ("heads", 6), ("context", 256), ("vocab", 4096),
                          ("batch", 8)]:
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--steps", type=int, default=3, help="Timed optimizer steps per model per round.")
    p.add_argument("--warmup", type=int, default=2, help="Untimed steps per model before the first round.")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--matmul", type=int, default=2048, help="n of the n x n fp32 matmul measuring the peak.")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's).")
    p.add_argument("--compile", action="store_true", help="torch.compile both models' forward.")
    p.add_argument("--out", default=None, help="Write the result as JSON here; 'auto': in bench/results/.")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)

    names = ["kubetrain GPT", "HF GPT2LMHeadModel"]
    built = {name: build(a) for name, build in zip(names, (ours, hf_gpt2), strict=True)}
    forwards = {name: torch.compile(f) if a.compile else f for name, (_, f, _) in built.items()}
    timers = {name: train_step(built[name][0], forwards[name], a) for name in names}
    mm, mm_reps, mm_flops = matmul(a.matmul), 10, 2 * a.matmul**3
    tokens = a.steps * a.batch * a.context
    load_before = os.getloadavg()[0]
    for t in timers.values():
        t(a.warmup)
    mm(2)

    rates: dict[str, dict[str, list[float]]] = {n: {"wall": [], "cpu": []} for n in [*names, "matmul"]}
    for r in range(a.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            wall, cpu = timers[name](a.steps)
            rates[name]["wall"].append(tokens / wall)
            rates[name]["cpu"].append(tokens / cpu)
        wall, cpu = mm(mm_reps)
        rates["matmul"]["wall"].append(mm_reps * mm_flops / wall)
        rates["matmul"]["cpu"].append(mm_reps * mm_flops / cpu)
        line = " | ".join(f"{n}: {rates[n]['wall'][-1]:,.0f} tok/s" for n in names)
        print(f"round {r + 1}/{a.rounds}: {line} | matmul {rates['matmul']['wall'][-1] / 1e9:,.1f} GFLOP/s",
              flush=True)

    print(f"\nshape: {a.layers} layers x {a.width} wide, {a.heads} heads, context {a.context}, "
          f"vocab {a.vocab}, batch {a.batch}, fp32, {torch.get_num_threads()} threads, "
          f"{'torch.compile' if a.compile else 'eager'}; "
          f"median of {a.rounds} rounds")
    results: dict[str, Any] = {}
    for clock in ("wall", "cpu"):
        peak = statistics.median(rates["matmul"][clock])
        per = {n: summary(n, statistics.median(rates[n][clock]), built[n][2], peak,
                          sum(p.numel() for p in built[n][0].parameters())) for n in names}
        ratio = per[names[0]]["tokens_per_second"] / per[names[1]]["tokens_per_second"]
        unit = "tok/s" if clock == "wall" else "tok per CPU-s"
        print(f"[{clock}] matmul limit ({a.matmul}^3 fp32): {peak / 1e9:,.1f} GFLOP/s")
        for n, res in per.items():
            print(f"[{clock}] {n:>19}: {res['tokens_per_second']:>7,.0f} {unit}"
                  f"  {res['params'] / 1e6:5.2f}M params"
                  f"  {res['flops_per_token'] / 1e6:5.1f} MFLOP/token  {res['gflops']:5.1f} GFLOP/s"
                  f"  MFU {100 * res['mfu']:4.1f}%")
        print(f"[{clock}] ratio kubetrain / HF GPT-2: {ratio:.3f}x")
        results[clock] = {"matmul_gflops": peak / 1e9, "models": per, "ratio": ratio}

    if a.out:
        record = {
            "benchmark": "bench/bench_gpt.py", "commit": commit(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "hardware": {"cpu": cpu_name(), "threads": torch.get_num_threads(), "cores": os.cpu_count()},
            "load_average": {"before": load_before, "after": os.getloadavg()[0]}, "torch": torch.__version__,
            "transformers": version("transformers"), "compile": a.compile,
            "shape": {k: getattr(a, k) for k in ("layers", "width", "heads", "context", "vocab", "batch")},
            "steps_per_round": a.steps, "rounds": a.rounds, "matmul_n": a.matmul,
            "results": results, "per_round": rates,
        }
        out = Path(a.out)
        if a.out == "auto":
            hw = re.sub(r"[^a-z0-9]+", "-", cpu_name().lower()).strip("-") + f"-{torch.get_num_threads()}t"
            day = datetime.date.today().isoformat()
            mode = "-compiled" if a.compile else ""
            out = ROOT / "bench" / "results" / f"gpt-{a.layers}x{a.width}-vs-hf-gpt2{mode}_{hw}_{day}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""The loss alone: kubetrain's chunked cross-entropy against cross-entropy on an fp32 copy of the logits (the loop's
loss before it ran inside the compiled step), kubetrain's head + loss fused chunk by chunk (models/loss.py
`LinearCrossEntropy`) and, where the installed torch has it (2.13+), torch's chunked F.linear_cross_entropy.

Forward and backward of the loss (with the head's matmul, so the three do the same work), rounds interleaved;
the median round's seconds, and the peak memory each adds (CUDA: the allocator's; the CPU: none, reported 0).

    .venv/bin/python bench/bench_loss.py [--tokens 2048 --width 256 --vocab 8192] [--out auto]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from provenance import save

from kubetrain.models.loss import LinearCrossEntropy, chunk_tokens, lm_loss_sum


def candidates() -> dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]]:
    found: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
        "chunked (kubetrain)": lambda h, w, y: lm_loss_sum(h @ w.T, y),
        "fp32 copy (before)": lambda h, w, y: F.cross_entropy((h @ w.T).float(), y, reduction="sum"),
        "fused head (kubetrain)": lambda h, w, y: LinearCrossEntropy.apply(h, w, None, y, chunk_tokens(w.shape[0])),
    }
    fused = getattr(F, "linear_cross_entropy", None)
    options = getattr(torch.nn, "LinearCrossEntropyOptions", None)
    if fused is not None and options is not None:
        found["F.linear_cross_entropy (torch)"] = lambda h, w, y: fused(h, w, y, reduction="sum",
                                                                        ignore_index=-100, options=options())
    return found


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    h = torch.randn(args.tokens, args.width, device=device, requires_grad=True)
    w = (torch.randn(args.vocab, args.width, device=device) * 0.05).requires_grad_()
    y = torch.randint(0, args.vocab, (args.tokens,), device=device)
    seconds: dict[str, list[float]] = {}
    losses: dict[str, float] = {}
    peaks: dict[str, int] = {}
    for _ in range(args.rounds):
        for name, fn in candidates().items():
            h.grad = w.grad = None
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            loss = fn(h, w, y)
            loss.backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
                peaks[name] = torch.cuda.max_memory_allocated()
            seconds.setdefault(name, []).append(time.perf_counter() - start)
            losses[name] = float(loss.detach())
    median = {name: statistics.median(s) for name, s in seconds.items()}
    ours = median["chunked (kubetrain)"]
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "shape": vars(args), "median_seconds": median, "over_ours": {n: s / ours for n, s in median.items()},
              "losses": losses, "peak_bytes": peaks, "date": datetime.date.today().isoformat()}
    if args.out:
        save(report, args.out, f"loss_{report['device'].lower().replace(' ', '-')}")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

"""Peak resident memory of one training step with the head and loss fused, against the whole logits (before).

A Llama-3.2-1B-shaped Hugging Face model (vocabulary 128,256, hidden 2048, tied embeddings, grouped-query
attention 32/8), cut to 2 layers, LoRA r16 on every linear but the head, built from its config (nothing downloaded;
random weights, fp32 as a CPU run loads it), at micro-batch 1 x 2048 tokens with a quarter of them a prompt. Each
variant runs forward + backward once in a fresh process (one after the other, never together: the peaks are the
processes' own), and reports its loss and peak RSS (getrusage's ru_maxrss):
- before: `lm_loss_sum(model(ids), labels)`, the whole logits (2048 x 128,256 fp32: 1 GiB) and the chunked loss;
- fused: train/loss.py `loss_step(model, compiled=False)`, what a training step runs now: the decoder's hidden
  states, then models/loss.py `linear_loss_sum` (head + loss chunk by chunk).

    .venv/bin/python bench/bench_head_loss.py [--layers 2 --tokens 2048 --threads 1] [--out auto]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from provenance import commit, save

ROOT = Path(__file__).resolve().parents[1]
VOCAB, HIDDEN, INTERMEDIATE, HEADS, KV_HEADS = 128_256, 2048, 8192, 32, 8  # Llama-3.2-1B's config.json


def step(variant: str, layers: int, tokens: int, rank: int) -> dict[str, float]:
    """One forward + backward of `variant` in this process: its loss, seconds and peak RSS (bytes)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kubetrain.config.schema import LoraConfig
    from kubetrain.models.hf import HFCausalLM
    from kubetrain.models.lora import apply_lora
    from kubetrain.models.loss import lm_loss_sum
    from kubetrain.train.loss import loss_step

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=layers,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=tokens,
                      tie_word_embeddings=True, rope_theta=500000.0)
    model = apply_lora(HFCausalLM(LlamaForCausalLM(cfg), tokens),
                       LoraConfig(r=rank, alpha=2 * rank, target_modules="all-linear"))
    ids = torch.randint(0, VOCAB, (1, tokens))
    labels = torch.randint(0, VOCAB, (1, tokens))
    labels[0, : tokens // 4] = -100  # a prompt
    run = loss_step(model, compiled=False) if variant == "fused" else (
        lambda i, y: lm_loss_sum(model(i), y))
    start = time.perf_counter()
    loss = run(ids, labels)
    loss.backward()
    seconds = time.perf_counter() - start
    return {"loss": float(loss.detach()), "seconds": seconds,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def measure(variant: str, layers: int, tokens: int, rank: int, threads: int) -> dict[str, float]:
    """`step` in a fresh interpreter, so its peak is its own."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    code = (f"import json, torch, sys; sys.path.insert(0, {str(ROOT / 'bench')!r}); torch.set_num_threads({threads});"
            f" from bench_head_loss import step; print(json.dumps(step({variant!r}, {layers}, {tokens}, {rank})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True,
                         timeout=1800)
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def compare(layers: int = 2, tokens: int = 2048, rank: int = 16, threads: int = 1) -> dict[str, object]:
    """Both variants, one after the other: their figures, the drop in peak RSS and its ratio."""
    before = measure("before", layers, tokens, rank, threads)
    fused = measure("fused", layers, tokens, rank, threads)
    drop = before["peak_rss_bytes"] - fused["peak_rss_bytes"]
    return {"before": before, "fused": fused, "drop_bytes": drop, "drop_gib": drop / 2**30,
            "fused_over_before": fused["peak_rss_bytes"] / before["peak_rss_bytes"],
            "loss_rel_diff": abs(fused["loss"] - before["loss"]) / abs(before["loss"])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out")
    args = ap.parse_args()
    import torch

    report = {"model": f"llama-3.2-1b shape, {args.layers} layers, LoRA r{args.rank} all-linear, fp32",
              "shape": {"micro_batch": 1, "tokens": args.tokens, "vocab": VOCAB, "hidden": HIDDEN},
              "threads": args.threads, "torch": torch.__version__, "date": datetime.date.today().isoformat(),
              "commit": commit(),
              **compare(args.layers, args.tokens, args.rank, args.threads)}
    if args.out:
        save(report, args.out, "head_loss_cpu")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

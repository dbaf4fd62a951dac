"""Packed vs unpacked chat, side by side in one run: real tokens per second, padding and a step's peak memory.

    PYTHONPATH=src:. python bench/bench_packing.py [--steps 6] [--warmup 2] [--threads 2] [--out auto]

The skewed chat set of the tests (tests/hf_models.py `skewed_chat_rows`: most conversations short, one in eight
near the window) is prepared twice, `data.chat.packing` false (one conversation per window, padded) and true
(best-fit-decreasing windows, each conversation attending only to itself), and trained by the loop's own pieces:
the loader's windows (data/loader.py), the step's loss (train/loss.py `loss_step`, eager), backward and AdamW.
Two models, each on its own window size (the smallest multiple of 64 that holds the longest conversation):
  gpt     kubetrain's GPT (4 x 128, byte tokenizer, chatml)
  llama   a Hugging Face Llama (4 x 128, GQA, the tests' Llama 3-style BPE tokenizer, sdpa)
Real tokens are the input positions that are not padding; tokens/s counts them from the end of the warm-up to the
last step. Each variant runs in its own process: its peak is its own (the resident memory a step adds over the
process before its first step, on the CPU). The JSON goes to bench/results/packing-<models>_cpu_<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from provenance import ROOT, commit, save

MODELS = ("gpt", "llama")
WIDTH, LAYERS, HEADS, BATCH = 128, 4, 4, 4


def build_assets(root: Path) -> None:
    """The skewed chat set and a random Llama with the tests' tokenizer, in root."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(ROOT))
    from tests.hf_models import build_tokenizer, skewed_chat_rows

    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in skewed_chat_rows(400, 180)))
    build_tokenizer(root / "llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=384, hidden_size=WIDTH, intermediate_size=3 * WIDTH, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=4096,
                      bos_token_id=0, eos_token_id=1, pad_token_id=4)
    LlamaForCausalLM(cfg).save_pretrained(str(root / "llama"))


def config(root: Path, model: str, packing: bool, block: int) -> Any:
    from kubetrain.config.loading import validate

    data: dict[str, Any] = {"sources": [{"kind": "chat", "path": str(root / "chat.jsonl")}], "val_fraction": 0.0,
                            "chat": {"packing": packing}, "cache_dir": str(root / "cache")}
    if model == "gpt":
        data["chat"]["template"] = "chatml"
        shape = {"n_layer": LAYERS, "n_head": HEADS, "n_embd": WIDTH, "block_size": block}
    else:
        data["tokenizer"] = {"kind": "hf", "path": str(root / "llama")}
        shape = {"kind": "hf", "name_or_path": str(root / "llama"), "block_size": block}
    return validate({"run": {"output_dir": str(root / "runs")}, "data": data, "model": shape})


def window_size(root: Path, model: str) -> int:
    """The smallest multiple of 64 that holds the longest conversation (none is cut)."""
    from kubetrain.data.chat import encode_conversations
    from kubetrain.data.shards import prepare

    cfg = config(root, model, False, 4096)
    tok = prepare(cfg).tokenizer()
    longest = max(len(ids) for ids, _ in encode_conversations(cfg.data.sources[0], tok, cfg.data.chat))
    return 64 * -(-longest // 64)


def rss_gib() -> float:
    import psutil

    return float(psutil.Process().memory_info().rss) / 2**30


def run_variant(root: Path, model: str, packing: bool, block: int, warmup: int, steps: int) -> dict[str, Any]:
    """Train `steps` steps after `warmup` on one preparation; what one process measured."""
    import torch

    from kubetrain.data.chat import pad_id
    from kubetrain.data.loader import TokenWindows, TrainLoader, counted_tokens
    from kubetrain.data.shards import prepare
    from kubetrain.models import build_model
    from kubetrain.train.loss import loss_step

    cfg = config(root, model, packing, block)
    prepared = prepare(cfg)
    tok = prepared.tokenizer()
    torch.manual_seed(0)
    net = build_model(cfg.model, tok.vocab_size).train()
    optimizer = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-3)
    loss_of = loss_step(net, compiled=False)
    windows = TokenWindows(prepared, "train", block)
    loader = TrainLoader(windows, BATCH, seed=0)
    pad = pad_id(tok)
    before = rss_gib()
    real = losses = 0
    start = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            start = time.perf_counter()
        batch = loader.next_batch()
        loss = loss_of(batch.input_ids, batch.labels, batch.position_ids) / counted_tokens(batch.labels).clamp(min=1)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= warmup:
            real += int((batch.input_ids != pad).sum())
            losses += int(counted_tokens(batch.labels))
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    packed = prepared.meta.get("packing")
    padding = 1 - packed["tokens"] / packed["positions"] if packed else None
    n_tokens = int(prepared.meta["tokens"])
    if padding is None:  # unpacked: every window one conversation, the rest padding
        all_tokens = prepared.tokens()[:]
        padding = float((all_tokens == pad).sum()) / n_tokens
    return {"model": model, "packing": packing, "block_size": block, "windows": windows.n_windows,
            "padding": round(padding, 4), "real_tokens_per_s": round(real / seconds, 1),
            "loss_tokens_per_s": round(losses / seconds, 1), "seconds_per_step": round(seconds / steps, 4),
            "step_peak_gib": round(peak - before, 3), "process_peak_gib": round(peak, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--out", default="auto", help="a file, or auto: bench/results/")
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # model,packing,block,root: one child process
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    if args.variant:
        model, packing, block, root = args.variant.split(",")
        print(json.dumps(run_variant(Path(root), model, packing == "1", int(block), args.warmup, args.steps)))
        return
    models = args.models.split(",")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build_assets(root)
        for model in models:
            block = window_size(root, model)
            for packing in (False, True):
                done = subprocess.run([sys.executable, __file__, "--variant", f"{model},{int(packing)},{block},{root}",
                                       "--steps", str(args.steps), "--warmup", str(args.warmup),
                                       "--threads", str(args.threads)], capture_output=True, text=True, check=True)
                rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(rows[-1], flush=True)
    ratios = {}
    for model in models:
        off, on = (next(r for r in rows if r["model"] == model and r["packing"] == p) for p in (False, True))
        ratios[model] = {"real_tokens_per_s": round(on["real_tokens_per_s"] / off["real_tokens_per_s"], 2),
                         "step_peak": round(on["step_peak_gib"] / max(off["step_peak_gib"], 1e-9), 2)}
    report = {"date": datetime.date.today().isoformat(), "commit": commit(), "machine": platform.processor() or
              platform.machine(), "threads": args.threads, "torch": torch.__version__, "batch": BATCH,
              "steps": args.steps, "warmup": args.warmup, "variants": rows, "packed_over_unpacked": ratios}
    path = save(report, args.out, f"packing-{'-'.join(models)}_cpu")
    print(json.dumps(ratios), "->", path)


if __name__ == "__main__":
    main()

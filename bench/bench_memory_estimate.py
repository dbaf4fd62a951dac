"""The CPU memory estimate against what the machine shows: `kubetrain doctor` vs the measured peak resident memory.

    PYTHONPATH=src python bench/bench_memory_estimate.py [--only NAME,...] [--out FILE]

For each case, `kubetrain doctor ... --json` gives the estimate of what the node's processes hold together
(`device_need`: every process's runtime, training state, loader batches, background checkpoint copy and eval
pass, and the `--nproc` launcher's runtime), then `kubetrain train` runs the same config for real (3 steps, a
background checkpoint at step 2 that overlaps step 3, the final evaluation) and every process it starts reports
its peak resident set (getrusage ru_maxrss, kubetrain/selftest/resident.py). The table is estimate, measured
(summed over the processes) and their ratio; the target is within 15%. One case at a time: the processes of a
case share the machine with nothing of the bench's own. Results: bench/results/memory_estimate_cpu_<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

from provenance import commit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests/hf_models.py builds the small Llama the LoRA case fine-tunes

COMMON = ["run.threads=1", "track.console=false", "eval.sample_prompt=null", "train.max_steps=3",
          "train.log_every_steps=1", "checkpoint.every_steps=2", "eval.every_steps=1000", "eval.windows=2",
          "train.warmup_steps=1"]
SMALL = ["model.n_layer=4", "model.n_embd=256", "model.n_head=4", "model.block_size=256",
         "train.micro_batch_size=8", "train.grad_accum_steps=1"]


def cases(work: Path) -> dict[str, tuple[list[str], int | None]]:
    """name -> (config arguments, --nproc or None for one process)."""
    return {
        "tiny": (["--preset", "tiny"], None),
        "gpt2-124m-mb2": (["--preset", "gpt2-124m", "--set", "data.tokenizer.kind=byte",
                           "--set", "train.micro_batch_size=2", "--set", "train.grad_accum_steps=1"], None),
        "gpt2-124m-mb4-bf16": (["--preset", "gpt2-124m", "--set", "data.tokenizer.kind=byte",
                                "--set", "train.micro_batch_size=4", "--set", "train.grad_accum_steps=1",
                                "--set", "train.precision=bf16"], None),
        "ddp-2": (["--preset", "tiny", *_sets(SMALL)], 2),
        "ddp-4": (["--preset", "tiny", *_sets(SMALL)], 4),
        "fsdp-4": (["--preset", "tiny", *_sets(SMALL), "--set", "dist.strategy=fsdp"], 4),
        "lora-hf-llama": (lora_args(work), None),
        "tiny-with-eval": (["--preset", "tiny", "--set", "eval.every_steps=1", "--set", "eval.windows=4"], None),
    }


def lora_args(work: Path) -> list[str]:
    """LoRA r8 on a random-initialised 2-layer Llama (hidden 256) with its tokenizer, on the tests' chat set."""
    from tests.hf_models import build_llama, build_tokenizer, chat_rows

    llama = work / "llama"
    if not (llama / "config.json").is_file():
        llama.mkdir(parents=True, exist_ok=True)
        tokenizer = build_tokenizer(work / "tokenizer")
        for f in tokenizer.iterdir():
            shutil.copy(f, llama / f.name)
        build_llama(llama, vocab=352, hidden=256)
        (work / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat_rows()))
    items = ["model.kind=hf", f"model.name_or_path={llama}", "model.block_size=64", "model.lora.r=8",
             "model.lora.alpha=16", "data.sources.0.kind=chat", f"data.sources.0.path={work / 'chat.jsonl'}",
             "data.val_fraction=0.1", "data.tokenizer.kind=hf", f"data.tokenizer.path={llama}",
             "train.micro_batch_size=4", "train.grad_accum_steps=1"]
    return ["--preset", "tiny", *_sets(items)]


def _sets(items: list[str]) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def main() -> None:
    from kubetrain.selftest.resident import estimate_against_peak

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--timeout", type=float, default=900, help="seconds each command may take")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        work = Path(tmp)
        chosen = cases(work)
        names = [n for n in args.only.split(",") if n] or list(chosen)
        for name in names:
            config_args, nproc = chosen[name]
            run = ["--set", f"run.name={name}", "--set", f"run.output_dir={work / 'runs'}",
                   "--set", f"data.cache_dir={work / 'data'}", *_sets(COMMON)]
            started = time.monotonic()
            row = estimate_against_peak([*config_args, *run], nproc, timeout=args.timeout, cwd=work)
            row = {"case": name, "nproc": nproc or 1, **row, "seconds": round(time.monotonic() - started, 1)}
            rows.append(row)
            print(f"{name:16} estimate {row['estimate_bytes'] / 2**20:8.0f} MiB  measured "
                  f"{row['measured_bytes'] / 2**20:8.0f} MiB  ratio {row['estimate_over_measured']:.3f}", flush=True)
    result = {"bench": "memory_estimate_cpu", "date": datetime.date.today().isoformat(), "commit": commit(),
              "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
                          "torch": _torch_version()},
              "settings": COMMON, "target": "0.85 <= estimate / measured <= 1.15", "rows": rows}
    out = args.out or ROOT / "bench" / "results" / f"memory_estimate_cpu_{result['date']}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


if __name__ == "__main__":
    main()

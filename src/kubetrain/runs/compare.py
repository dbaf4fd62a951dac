"""`kubetrain runs compare`: each run's final and best losses and throughput, and the config keys that differ.

A run with phases compares as one entry per phase, in the order they ran.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from kubetrain.config.loading import flatten
from kubetrain.runs.reader import RunRecords, expand, preflight_summary, read_config, read_meta
from kubetrain.secrets import redact


def summarize(rec: RunRecords) -> dict[str, Any]:
    """Final and best losses, tokens and median throughput of one run."""
    meta = read_meta(rec.path)
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
        # the links the job started on: a run slower than its twin may simply have had a slower network
        "preflight": preflight_summary(rec.path),
    }


def config_differences(paths: list[Path]) -> dict[str, list[Any]]:
    """Only the config keys whose values differ between the runs (None where a run lacks the key)."""
    flat = [flatten(redact(read_config(p))) for p in paths]
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

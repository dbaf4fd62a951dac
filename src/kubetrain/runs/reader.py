"""Read run directories back: meta, config, metrics, phases and checkpoints, for `kubetrain runs
list/show/compare/plot` (and for the loop, which reopens its own run).

A run with phases is read as its phases, in the order they started.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kubetrain import checkpoint
from kubetrain.errors import UserInputError
from kubetrain.runs.incidents import read_all as read_incidents
from kubetrain.runs.layout import CHECKPOINTS, CONFIG_FILE, META_FILE, METRICS_FILE, PHASES, PHASES_FILE, PREFLIGHT_FILE


def read_meta(path: Path, name: str = META_FILE) -> dict[str, Any]:
    """The run's meta.json (or another JSON object of the run, `name`), or {} when it is missing or unreadable."""
    try:
        data = json.loads((path / name).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, json.JSONDecodeError):
        return {}


def read_config(path: Path) -> dict[str, Any]:
    """The run's config.yaml as a mapping, or {} when it is missing or unreadable."""
    try:
        data = yaml.safe_load((path / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file; a line cut short by a kill, or one that is not a JSON object (not
    UTF-8, a list, a number), is skipped."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_bytes().splitlines():
        try:
            record = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def read_preflight(path: Path) -> dict[str, Any]:
    """The job's preflight report (distributed/preflight.py), or {}; a phase reads its run's (one per job)."""
    found = read_meta(path, PREFLIGHT_FILE)
    if not found and path.parent.name == PHASES:
        found = read_meta(path.parent.parent, PREFLIGHT_FILE)
    return found


def preflight_summary(path: Path) -> dict[str, Any] | None:
    """What `runs show` and `runs compare` say about the preflight: verdict, time, medians, the slowest link."""
    report = read_preflight(path)
    if not report.get("verdict"):
        return None
    verdict, rows = report["verdict"], report.get("links") or []
    return {"ok": bool(verdict.get("ok")), "seconds": report.get("seconds"), "world_size": report.get("world_size"),
            "backend": report.get("backend"), "all_reduce_busbw": report.get("median_all_reduce_busbw"),
            "link_bandwidth": report.get("median_link_bandwidth"),
            "slowest_link": min(rows, key=lambda r: r["bandwidth"]) if rows else None,
            "problems": verdict.get("problems") or [], "warnings": verdict.get("warnings") or []}


def phase_dirs(path: Path) -> list[Path]:
    """The phase run directories of a multi-phase run, in the order they started ([] for a single run)."""
    if not (path / PHASES).is_dir():
        return []
    found = [d for d in (path / PHASES).iterdir() if d.is_dir()]
    return sorted(found, key=lambda d: read_meta(d).get("started_at", 0))


def last_finished_phase(path: Path) -> Path | None:
    """The phase of a multi-phase run that finished last (what generate and export use); None when none has."""
    finished = [d for d in phase_dirs(path) if read_meta(d).get("status") == "finished"]
    return max(finished, key=lambda d: read_meta(d).get("finished_at", 0), default=None)


@dataclass
class RunRecords:
    """One run (or phase) and its metrics.jsonl, split by kind."""

    label: str
    path: Path
    train: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def read(cls, label: str, path: Path) -> RunRecords:
        records = read_metrics(path / METRICS_FILE)
        train = [r for r in records if r.get("kind") == "train" and r.get("loss") is not None]
        evals = [r for r in records if r.get("kind") == "eval" and r.get("val_loss") is not None]
        return cls(label, path, train, evals)


def expand(paths: list[Path]) -> list[tuple[str, Path]]:
    """(label, directory) of every run to show, a run with phases as its phases; bad paths are user errors."""
    found: list[tuple[str, Path]] = []
    for p in paths:
        if not p.is_dir():
            raise UserInputError(f"no such run directory: {p}")
        if (p / METRICS_FILE).is_file() or (p / CONFIG_FILE).is_file():
            found.append((p.name, p))
        elif phases := phase_dirs(p):
            found.extend((f"{p.name}/{d.name}", d) for d in phases)
        else:
            raise UserInputError(f"not a run directory (no {METRICS_FILE} or {CONFIG_FILE}): {p}")
    labels = [label for label, _ in found]
    if len(set(labels)) != len(labels):  # same run name under different output folders
        found = [(str(path), path) for _, path in found]
    return found


def _status(meta: dict[str, Any]) -> str:
    status = str(meta.get("status", "unknown"))
    if status == "running" and meta.get("host") == os.uname().nodename and meta.get("pid"):
        try:
            os.kill(int(meta["pid"]), 0)
        except ProcessLookupError:
            return "failed"  # the process that was running it is gone without saying so (killed)
        except PermissionError:
            pass
    return status


def is_run_dir(path: Path) -> bool:
    """A run directory (meta.json or config.yaml), or a run of phases (phases/)."""
    return ((path / META_FILE).is_file() or (path / CONFIG_FILE).is_file() or bool(phase_dirs(path))
            or (path / PREFLIGHT_FILE).is_file())  # a job the preflight stopped before it wrote anything else


def describe_run(path: Path) -> dict[str, Any]:
    """One run's summary for `runs show`; a multi-phase run reports its newest phase."""
    meta = read_meta(path)
    phases = phase_dirs(path)
    status = _status(meta)
    if phases and not meta:
        current = phases[-1]
        meta = read_meta(current)
        root = current / CHECKPOINTS
        status = _status(meta)
        whole = read_meta(path, PHASES_FILE)  # the run as a whole: phase 3 failing after 2 finished is a failure
        if whole:
            status = _status(whole)
            if whole.get("phase") and whole.get("phase") != meta.get("phase"):  # it failed before its meta.json
                meta = {**meta, "phase": whole["phase"]}
    else:
        root = path / CHECKPOINTS
    preflight = preflight_summary(path)
    if not meta and preflight and not preflight["ok"]:
        status = "failed"  # stopped by the preflight before step 1 (no meta.json yet)
    return {
        "name": path.name,
        "path": str(path),
        "status": status,
        "phase": meta.get("phase"),
        "phases": [p.name for p in phases],
        "step": int(meta.get("step", 0)),
        "tokens": int(meta.get("tokens", 0)),
        "best_val_loss": meta.get("best_val_loss"),
        "final_val_loss": meta.get("final_val_loss"),
        "latest": checkpoint.pointer(root, checkpoint.LATEST),
        "best": checkpoint.pointer(root, checkpoint.BEST),
        "checkpoints": [p.name for p in checkpoint.complete_checkpoints(root)],
        "world_size": meta.get("world_size"),
        "started_at": meta.get("started_at"),
        "incidents": read_incidents(path),
        "preflight": preflight,
    }


def list_runs(folder: Path) -> list[dict[str, Any]]:
    """Every run directly under `folder`, for `runs list`."""
    if not folder.is_dir():
        return []
    found = [p for p in sorted(folder.iterdir()) if p.is_dir() and not p.name.startswith(".") and is_run_dir(p)]
    return [describe_run(p) for p in found]

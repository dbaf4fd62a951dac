"""Start a run directory and keep its meta.json: who started it, with what, what changed; secrets redacted.

Reading runs back (list, show, compare, plot) is runs.reader.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

import kubetrain
from kubetrain.config.loading import config_hash, flatten
from kubetrain.config.schema import Config
from kubetrain.files import write_atomic
from kubetrain.runs.incidents import read_all as read_incidents
from kubetrain.runs.layout import CONFIG_FILE, META_FILE, PHASES_FILE
from kubetrain.runs.reader import read_meta
from kubetrain.secrets import redact


def git_sha() -> str | None:
    here = Path(kubetrain.__file__).resolve().parent
    for cwd in (Path.cwd(), here):
        try:
            out = subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5, check=False
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        if out.returncode == 0:
            return out.stdout.strip()
    return None


def config_changes(path: Path, cfg: Config) -> list[str]:
    """What differs between the config a run was last started with and this one ("train.lr: 0.003 -> 0.001")."""
    try:
        old = yaml.safe_load((path / CONFIG_FILE).read_text())
    except (OSError, yaml.YAMLError):
        return []
    # both sides redacted: config.yaml on disk is, and a secret must not show up as a change (or in one)
    before, after = flatten(redact(old if isinstance(old, dict) else {})), flatten(redacted_config(cfg))
    keys = sorted(set(before) | set(after))
    changed = [k for k in keys if before.get(k) != after.get(k)]
    return [f"{k}: {before.get(k)!r} -> {after.get(k)!r}" for k in changed]


def redacted_config(cfg: Config) -> dict[str, Any]:
    """The resolved config as config.yaml holds it: every default filled in, secrets redacted."""
    data: dict[str, Any] = redact(cfg.model_dump(mode="json"))
    return data


def start(path: Path, cfg: Config, argv: list[str], world_size: int, phase: str | None = None,
          restart: int = 0) -> dict[str, Any]:
    """Create (or reopen) a run directory and record who started it, with what (and what changed since).

    `starts` counts starts by a new launcher (a resume: a pod restart, a relaunch); `restart`, the elastic agent's
    restart round of its workers, is counted apart in `worker_restarts`.
    """
    import torch

    path.mkdir(parents=True, exist_ok=True)
    previous = read_meta(path)
    changes = config_changes(path, cfg)
    write_atomic(path / CONFIG_FILE, yaml.safe_dump(redacted_config(cfg), sort_keys=False))
    meta = {
        "run": cfg.run.name,
        "kubetrain_version": kubetrain.__version__,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "git_sha": git_sha(),
        "argv": redact([Path(sys.argv[0]).name, *argv]),
        "host": socket.gethostname(),
        "world_size": world_size,
        "config_hash": config_hash(cfg),
        "created_at": previous.get("created_at", time.time()),
        "started_at": time.time(),
        "starts": max(1, int(previous.get("starts", 0)) + (0 if restart else 1)),
        "worker_restarts": int(previous.get("worker_restarts", 0)) + (1 if restart else 0),
        "status": "running",
        "phase": phase,
        "pid": os.getpid(),
        "config_changes": changes,
        "history": [*previous.get("history", []), *([{"at": time.time(), "changes": changes}] if changes else [])],
        "incidents": read_incidents(path),  # what ended the previous attempts, recorded by the launcher
        # each tracker's run of this run (W&B's run id), so that a resume continues it: kept across starts
        "trackers": previous.get("trackers", {}),
    }
    write_atomic(path / META_FILE, json.dumps(redact(meta), indent=2))
    return meta


def update_meta(path: Path, **fields: Any) -> None:
    meta = read_meta(path)
    meta.update(fields)
    meta["updated_at"] = time.time()
    write_atomic(path / META_FILE, json.dumps(redact(meta), indent=2))


def record_tracker(path: Path, tracker: str, identity: dict[str, Any]) -> None:
    """Keep a tracker's run identity (meta.json `trackers.<tracker>`) for the next start of this run."""
    trackers = read_meta(path).get("trackers") or {}
    update_meta(path, trackers={**trackers, tracker: identity})


def record_phases(path: Path, names: list[str], status: str, phase: str) -> None:
    """How a run of phases stands as a whole (phases.json): a phase that failed fails the run, whatever the phases
    before it say."""
    record = {"phases": names, "status": status, "phase": phase, "host": socket.gethostname(), "pid": os.getpid(),
              "updated_at": time.time()}
    path.mkdir(parents=True, exist_ok=True)
    write_atomic(path / PHASES_FILE, json.dumps(record, indent=2))

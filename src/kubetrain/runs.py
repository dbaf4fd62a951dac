"""The run directory: layout, meta.json (secrets redacted), status, listing."""

from __future__ import annotations

import json
import os
import platform
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import kubetrain
from kubetrain.config.loading import config_hash, to_yaml
from kubetrain.config.schema import Config

CONFIG_FILE = "config.yaml"
META_FILE = "meta.json"
METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.txt"
CHECKPOINTS = "checkpoints"

STATUSES = ("running", "stopped", "finished", "failed")

_SECRET_KEY = re.compile(r"(token|password|passwd|secret|api[_-]?key|credential|auth)", re.IGNORECASE)
_SECRET_VALUE = [
    re.compile(r"hf_[A-Za-z0-9]{16,}"),  # Hugging Face tokens
    re.compile(r"gh[pousr]_[A-Za-z0-9]{20,}"),  # GitHub tokens
    re.compile(r"sk-[A-Za-z0-9_-]{16,}"),  # OpenAI-style keys
    re.compile(r"AKIA[0-9A-Z]{16}"),  # AWS access key ids
    re.compile(r"eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}"),  # JWTs (service account tokens)
]
_URL_PASSWORD = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<user>[^:/@\s]+):(?P<pw>[^@/\s]+)@", re.IGNORECASE)
REDACTED = "***"


def redact_text(text: str) -> str:
    """The text with anything that looks like a token, key or URL password replaced."""
    text = _URL_PASSWORD.sub(lambda m: f"{m['scheme']}{m['user']}:{REDACTED}@", text)
    for pattern in _SECRET_VALUE:
        text = pattern.sub(REDACTED, text)
    # KEY=VALUE pairs (argv overrides, env) whose key names a secret
    return re.sub(
        r"(?P<k>[\w.-]*(?:token|password|passwd|secret|api[_-]?key)[\w.-]*)=(?P<v>[^\s,]+)",
        lambda m: f"{m['k']}={REDACTED}",
        text,
        flags=re.IGNORECASE,
    )


def redact(value: Any, key: str = "") -> Any:
    """A copy of a JSON-like value with secrets redacted, by key name and by value shape."""
    if isinstance(value, dict):
        return {k: redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v, key) for v in value]
    if isinstance(value, str):
        if key and _SECRET_KEY.search(key) and not key.endswith(("_env", "_key_name", "secret_name", "_field")):
            return REDACTED if value else value
        return redact_text(value)
    return value


def run_dir(cfg: Config) -> Path:
    return Path(cfg.run.output_dir).expanduser() / cfg.run.name


def write_atomic(path: Path, text: str) -> None:
    """Write a small file so that readers see the old or the new content, never half of it."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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


def read_meta(path: Path) -> dict[str, Any]:
    try:
        data = json.loads((path / META_FILE).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, json.JSONDecodeError):
        return {}


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """{"train.lr": 0.001, ...} for a nested mapping (lists stay whole)."""
    if not isinstance(value, dict):
        return {prefix: value}
    out: dict[str, Any] = {}
    for k, v in value.items():
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def config_changes(path: Path, cfg: Config) -> list[str]:
    """What differs between the config a run was last started with and this one ("train.lr: 0.003 -> 0.001")."""
    import yaml

    try:
        old = yaml.safe_load((path / CONFIG_FILE).read_text())
    except (OSError, yaml.YAMLError):
        return []
    before, after = flatten(old or {}), flatten(cfg.model_dump(mode="json"))
    keys = sorted(set(before) | set(after))
    changed = [k for k in keys if before.get(k) != after.get(k)]
    return [f"{k}: {redact(before.get(k), k)!r} -> {redact(after.get(k), k)!r}" for k in changed]


def start(path: Path, cfg: Config, argv: list[str], world_size: int, phase: str | None = None) -> dict[str, Any]:
    """Create (or reopen) a run directory and record who started it, with what (and what changed since)."""
    import torch

    path.mkdir(parents=True, exist_ok=True)
    previous = read_meta(path)
    changes = config_changes(path, cfg)
    write_atomic(path / CONFIG_FILE, to_yaml(cfg))
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
        "starts": int(previous.get("starts", 0)) + 1,
        "status": "running",
        "phase": phase,
        "pid": os.getpid(),
        "config_changes": changes,
        "history": [*previous.get("history", []), *([{"at": time.time(), "changes": changes}] if changes else [])],
    }
    write_atomic(path / META_FILE, json.dumps(redact(meta), indent=2))
    return meta


def update_meta(path: Path, **fields: Any) -> None:
    meta = read_meta(path)
    meta.update(fields)
    meta["updated_at"] = time.time()
    write_atomic(path / META_FILE, json.dumps(redact(meta), indent=2))

"""What went wrong during a run, and what was done about it: one JSON file per incident in `<run>/incidents/`.

The launcher records hangs, worker exits and preemptions there while the workers are being ended (so it
never races rank 0 on meta.json); meta.json's `incidents` is the same list, copied in when a run starts
(rank 0) and when the launcher ends.
"""

from __future__ import annotations

import calendar
import json
import os
import re
import time
from pathlib import Path
from typing import Any, Literal

from kubetrain.files import write_atomic

INCIDENTS = "incidents"
KINDS = ("hang", "timeout", "worker-exit", "oom", "preempted", "rendezvous-lost", "rendezvous-closed", "preflight")
Kind = Literal["hang", "timeout", "worker-exit", "oom", "preempted", "rendezvous-lost", "rendezvous-closed",
               "preflight"]
# The one line the launcher prints per incident; `k8s status` finds the newest in the pods' logs (the run folder
# is on a claim it cannot read). Kept stable: log_line writes it, parse_log_line reads it.
_LINE = re.compile(
    r"^incident: (?P<kind>" + "|".join(KINDS) + r")(?: on rank (?P<rank>\d+))?(?: at step (?P<step>\d+))?"
    r" \((?P<time>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)\):\s*(?P<message>.*)$"
)


def incidents_dir(run_dir: Path) -> Path:
    return run_dir / INCIDENTS


def record(run_dir: Path, kind: Kind, *, rank: int | None, step: int | None, message: str,
           stacks: Path | None = None, **extra: Any) -> dict[str, Any]:
    """Write one incident (kind, rank, step, time, message, the stacks file relative to the run) and return it."""
    now = time.time()
    folder = incidents_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    entry: dict[str, Any] = {"kind": kind, "rank": rank, "step": step, "time": now, "message": message,
                             "stacks": str(stacks.relative_to(run_dir)) if stacks else None, **extra}
    name = f"{stamp(now)}-{kind}-{os.getpid()}.json"
    write_atomic(folder / name, json.dumps(entry, indent=2))
    return entry


def stamp(at: float) -> str:
    """A file-name prefix that sorts by time: 20260124T051522.123Z."""
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(at)) + f".{int(at * 1000) % 1000:03d}Z"


def read_all(run_dir: Path) -> list[dict[str, Any]]:
    """Every incident of the run, oldest first (an unreadable file is skipped: it is a record, not state)."""
    folder = incidents_dir(run_dir)
    if not folder.is_dir():
        return []
    found = []
    for f in sorted(folder.glob("*.json")):
        try:
            entry = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(entry, dict) and entry.get("kind") in KINDS:
            found.append(entry)
    return sorted(found, key=lambda e: float(e.get("time", 0)))


def describe(entry: dict[str, Any]) -> str:
    """One line for people: `hang at step 12 (rank 2): no rank advanced for 30s; stacks: incidents/...`."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(entry.get("time", 0))))
    where = f" at step {entry['step']}" if entry.get("step") is not None else ""
    who = f" (rank {entry['rank']})" if entry.get("rank") is not None else ""
    stacks = f"; stacks: {entry['stacks']}" if entry.get("stacks") else ""
    return f"{when} {entry['kind']}{where}{who}: {entry.get('message', '')}{stacks}"


def log_line(entry: dict[str, Any], run_dir: Path | None = None) -> str:
    """The launcher's line for an incident: `incident: hang on rank 2 at step 340 (2026-11-24T05:12:40Z): ...`.

    One line (the message's first), parsed back by `parse_log_line`; `run_dir` makes the stacks path one a
    reader of the log can open.
    """
    who = f" on rank {entry['rank']}" if entry.get("rank") is not None else ""
    where = f" at step {entry['step']}" if entry.get("step") is not None else ""
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(float(entry.get("time", 0))))
    message = (str(entry.get("message") or "").splitlines() or [""])[0]
    if entry.get("stacks"):
        message += f"; stacks in {run_dir / entry['stacks'] if run_dir else entry['stacks']}"
    return f"incident: {entry['kind']}{who}{where} ({when}): {message}"


def parse_log_line(line: str) -> dict[str, Any] | None:
    """An incident (kind, rank, step, time, message) from a line `log_line` wrote, or None for any other line."""
    found = _LINE.match(line.strip())
    if found is None:
        return None
    rank, step = found.group("rank"), found.group("step")
    return {"kind": found.group("kind"), "rank": int(rank) if rank else None, "step": int(step) if step else None,
            "time": float(calendar.timegm(time.strptime(found.group("time"), "%Y-%m-%dT%H:%M:%SZ"))),
            "message": found.group("message")}

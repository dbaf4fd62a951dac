"""metrics.jsonl: one JSON object per logged step or evaluation, always on."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubetrain.secrets import redact
from kubetrain.track import Sink


def truncate_after(path: Path, step: int, warn: Callable[[str], None] | None = None) -> None:
    """Drop records past `step` (written after the checkpoint a resume starts from), so the file stays one run.

    A line that is not a record (not UTF-8, JSON that is not an object, a step that is not a number) is not ours to
    judge: it is kept as it is, and `warn` hears of such lines once. A line cut short by a kill is dropped.
    """
    if not path.is_file():
        return
    kept: list[bytes] = []
    foreign: list[int] = []  # line numbers of the lines kept without reading them
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            whole = line if line.endswith(b"\n") else line + b"\n"
            try:
                rec = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError:
                foreign.append(number)
                kept.append(whole)
                continue
            except json.JSONDecodeError:
                continue  # a line cut short by a kill
            try:
                rec_step = int(rec.get("step", 0)) if isinstance(rec, dict) else None
            except (TypeError, ValueError):
                rec_step = None
            if rec_step is None:
                foreign.append(number)
                kept.append(whole)
            elif rec_step <= step:
                kept.append(whole)
    if foreign and warn is not None:
        lines = ", ".join(str(n) for n in foreign[:5]) + (" ..." if len(foreign) > 5 else "")
        warn(f"{path}: {len(foreign)} line(s) are not records (not UTF-8, or not a JSON object with a numeric step): "
             f"kept as they are (line {lines})")
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(b"".join(kept))
    os.replace(tmp, path)


class JsonlSink(Sink):
    name = "metrics.jsonl"

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - kept open for the whole run

    def log(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(redact(record)) + "\n")
        self.file.flush()

    def finish(self, status: str) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()

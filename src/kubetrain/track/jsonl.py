"""metrics.jsonl: one JSON object per logged step or evaluation, always on."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kubetrain.secrets import redact
from kubetrain.track import Sink


def truncate_after(path: Path, step: int) -> None:
    """Drop records past `step` (written after the checkpoint a resume starts from), so the file stays one run."""
    if not path.is_file():
        return
    kept = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a kill
            if int(rec.get("step", 0)) <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
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

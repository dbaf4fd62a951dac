"""The job's preflight as `kubetrain k8s status` shows it, read from the pods' logs (the run folder's
preflight.json is on a claim this command cannot read): rank 0's head line and verdict, or the one line that
stopped the job (distributed/preflight.py prints them)."""

from __future__ import annotations

import re
from typing import Any

_HEAD = re.compile(r"preflight: (?P<world>\d+) ranks over (?P<backend>\w+) in (?P<seconds>[\d.]+) s")
_OK = re.compile(r"preflight: ok \((?P<detail>.*)\)\s*$")
# a rank or link named (warned or stopped), the job's all-reduce under its floor, a phase past its deadline
_FAILED = re.compile(r"^(?:error: )?(?P<line>preflight: (?:rank |link |job: |not finished ).*?)"
                     r"(?: \(dist\.preflight\.on_failure.*)?$")


def preflight_from_logs(logs: dict[str, list[str]]) -> dict[str, Any] | None:
    """{world_size, backend, seconds, ok, detail | problem, log} from the newest preflight in these logs; None when
    none is there (one process, the preflight off, or its lines older than the logs' tails)."""
    found: dict[str, Any] | None = None
    for source, lines in logs.items():
        for raw in lines:
            line = re.sub(r"^\[rank \d+\] ", "", raw.strip())
            if head := _HEAD.match(line):
                found = {"world_size": int(head["world"]), "backend": head["backend"],
                         "seconds": float(head["seconds"]), "ok": None, "log": source}
            elif found is not None and (ok := _OK.match(line)):
                found.update(ok=True, detail=ok["detail"])
            elif failed := _FAILED.match(line):
                found = found or {"world_size": None, "backend": None, "seconds": None, "log": source}
                found.update(ok=False, problem=failed["line"])
    return found


def preflight_text(found: dict[str, Any]) -> str:
    """`preflight: ok in 1.2 s over 4 ranks (gloo): job all-reduce 0.77 GB/s, ...` or the line that named a rank."""
    if found.get("ok") is False:
        return f"{found['problem']} [{found['log']}]"
    where = f" in {found['seconds']:g} s over {found['world_size']} ranks ({found['backend']})" \
        if found.get("seconds") is not None else ""
    verdict = "ok" if found.get("ok") else "running"
    return f"preflight: {verdict}{where}" + (f": {found['detail']}" if found.get("detail") else "")

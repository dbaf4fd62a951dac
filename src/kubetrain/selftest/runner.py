"""Run every group of checks in its own process and gather one report (what `doctor --check` prints)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubetrain.selftest import GROUPS, STATUSES, Outcome
from kubetrain.selftest.context import Context
from kubetrain.selftest.group import MARK

# A group that runs longer is stopped and its unfinished items failed; one H100 finishes all in about 6 minutes.
GROUP_TIMEOUT = {"quick": 300.0, "full": 420.0}


def run_check(quick: bool | None = None, on_item: Callable[[Outcome], None] | None = None,
              groups: tuple[str, ...] = tuple(GROUPS), nproc: int = 1) -> dict[str, Any]:
    """The self-test on this machine's device (`groups` of it, in GROUPS' order: all by default); quick (tiny
    shapes, few steps) by default on the CPU; `nproc` processes for the link test (distributed.links)."""
    import torch

    from kubetrain import __version__, hardware
    from kubetrain.train.device import select_device

    device = select_device("auto")
    quick = device.type == "cpu" if quick is None else quick
    started = time.time()
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="kubetrain-check-") as work:
        ctx = Context(device=device.type, quick=quick, work=Path(work), nproc=nproc)
        for group in (g for g in GROUPS if g in groups):
            for outcome in run_group(group, ctx, GROUP_TIMEOUT["quick" if quick else "full"]):
                outcomes.append(outcome)
                if on_item:
                    on_item(outcome)
    counts = {status: sum(o.status == status for o in outcomes) for status in STATUSES}
    return {
        "kubetrain": __version__, "mode": "quick" if quick else "full", "groups": [g for g in GROUPS if g in groups],
        "device": hardware.device_info(device).to_json(),
        "versions": hardware.versions(), "python": sys.version.split()[0], "torch_threads": torch.get_num_threads(),
        "started_at": started, "seconds": round(time.time() - started, 1), "items": [o.to_json() for o in outcomes],
        "summary": counts, "ok": counts["failed"] == 0,
    }


def run_group(group: str, ctx: Context, timeout: float) -> list[Outcome]:
    """The outcomes of one group's process; items it never reported (it crashed or ran out of time) fail."""
    skip_group = getattr(importlib.import_module(f"kubetrain.selftest.{group}"), "skip_group", None)
    why = skip_group(ctx) if skip_group else None
    if why:
        return [Outcome(name, "skipped", why) for name in GROUPS[group]]
    cmd = [sys.executable, "-m", "kubetrain.selftest.group", group, *ctx.argv()]
    log = ctx.work / f"{group}.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "w") as err:
        try:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, timeout=timeout, env=env,
                                  check=False)
            stdout, ended = proc.stdout, f"its process exited {proc.returncode}"
        except subprocess.TimeoutExpired as e:
            out = e.stdout or ""
            stdout = out.decode(errors="replace") if isinstance(out, bytes) else out
            ended = f"the group did not finish within {timeout:.0f}s"
    reported = {}
    for line in stdout.splitlines():
        if line.startswith(MARK):
            item = json.loads(line[len(MARK):])
            reported[item["name"]] = Outcome(**item)
    tail = _last_error(log)
    return [reported.get(name) or Outcome(name, "failed", f"not reported: {ended}" + (f" ({tail})" if tail else ""))
            for name in GROUPS[group]]


def _last_error(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


"""The peak resident memory of a `kubetrain` command and every process it starts: what the CPU estimate is checked by.

Each Python process of the command (the launcher and every worker torchrun starts) reports its own
`getrusage(RUSAGE_SELF).ru_maxrss` when it exits, through a `sitecustomize` module put first on PYTHONPATH for it:
no sampling, so no short peak is missed, and every process counts, whoever started it. The sum over the processes
is what they held together at most (they peak together: the ranks of a step run in lockstep), the figure
`kubetrain doctor`'s `device_need` estimates. Linux and macOS (ru_maxrss is KiB on Linux, bytes on macOS).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPORT_ENV = "KUBETRAIN_MAXRSS_DIR"
# Written at exit by each process (atexit runs on a normal exit and on SystemExit, which is how the CLI exits).
SITECUSTOMIZE = f'''
import atexit, json, os, resource, sys

def _report():
    folder = os.environ.get("{REPORT_ENV}")
    if not folder:
        return
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    with open(os.path.join(folder, f"{{os.getpid()}}.json"), "w") as f:
        json.dump({{"pid": os.getpid(), "ppid": os.getppid(), "maxrss": peak, "argv": sys.argv[:3]}}, f)

atexit.register(_report)
'''


@dataclass(frozen=True)
class Measured:
    """What a command's processes held at most, each and together, and how the command ended."""

    returncode: int
    stderr: str
    stdout: str
    per_process: tuple[int, ...]  # bytes, each process's peak resident set, largest first
    ranks: tuple[int, ...] = ()  # bytes, the training processes a launcher started (not it, nor their helpers)

    @property
    def total(self) -> int:
        return sum(self.per_process)


def measure(args: list[str], timeout: float, env: dict[str, str] | None = None, cwd: Path | None = None) -> Measured:
    """Run `python -m kubetrain ARGS` (this interpreter) and sum the peak resident memory of its processes."""
    with tempfile.TemporaryDirectory(prefix="kubetrain-maxrss-") as tmp:
        hook, reports = Path(tmp) / "hook", Path(tmp) / "reports"
        hook.mkdir()
        reports.mkdir()
        (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        path = os.pathsep.join(p for p in (str(hook), full_env.get("PYTHONPATH", "")) if p)
        full_env |= {"PYTHONPATH": path, REPORT_ENV: str(reports)}
        # Through a shell that forks it: Linux carries a process's peak over exec (signal->maxrss), so a command
        # forked straight from a large process (a test worker that trained in-process: 1.2 GiB) would report that
        # process's size as its own peak. The shell is small, and its child starts from the shell's size.
        command = ["/bin/sh", "-c", '"$@"; exit $?', "sh", sys.executable, "-m", "kubetrain", *args]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd,
                              check=False)
        found = [json.loads(p.read_text()) for p in reports.glob("*.json")]
    pids = {r["pid"] for r in found}
    # a rank is a kubetrain process started by another (the launcher); a compile worker runs another module
    ranks = [r["maxrss"] for r in found if r.get("ppid") in pids and r["argv"][:1]
             and Path(r["argv"][0]).parent.name == "kubetrain"]
    peaks = sorted((r["maxrss"] for r in found), reverse=True)
    return Measured(proc.returncode, proc.stderr, proc.stdout, tuple(peaks), tuple(sorted(ranks, reverse=True)))


def estimate_against_peak(config_args: list[str], nproc: int | None = None, timeout: float = 900,
                          cwd: Path | None = None, env: dict[str, str] | None = None) -> dict[str, Any]:
    """`kubetrain doctor`'s estimate of what the node's processes hold together (its `device_need`) for
    CONFIG_ARGS (a config or --preset, and --set items) beside the peak resident memory measured over every process
    of `kubetrain train` with the same arguments (`nproc`: through the launcher, `--oversubscribe` allowed).
    Raises RuntimeError with the command's last line when either command fails."""
    launch = ["--nproc", str(nproc), "--oversubscribe"] if nproc else []
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    doctor = subprocess.run([sys.executable, "-m", "kubetrain", "doctor", *config_args, *launch, "--json"],
                            capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd,
                            check=False)
    if doctor.returncode:
        raise RuntimeError(f"kubetrain doctor exited {doctor.returncode}: {_last(doctor.stderr)}")
    fit = json.loads(doctor.stdout)["fit"]
    run = measure(["train", *config_args, *launch, "--resume", "never",
                   *(["--max-restarts", "0"] if nproc else [])], timeout, env, cwd)
    if run.returncode:
        raise RuntimeError(f"kubetrain train exited {run.returncode}: {_last(run.stderr)}")
    return {"estimate_bytes": fit["device_need"], "measured_bytes": run.total,
            "estimate_over_measured": fit["device_need"] / run.total, "processes": len(run.per_process),
            "measured_per_process": list(run.per_process), "parts": fit["parts"]}


def _last(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""

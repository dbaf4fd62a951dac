"""What every bench script records with its figures: the commit measured, and where its JSON report goes.

Imported as a sibling (`python bench/bench_x.py` puts bench/ first on sys.path).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def commit() -> str:
    """The checkout's short commit, `-dirty` when src/ or bench/ differ from it; `unknown` outside a git checkout."""

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                              check=False).stdout.strip()

    sha = git("rev-parse", "--short", "HEAD") or "unknown"
    return sha + ("-dirty" if git("status", "--porcelain", "--untracked-files=no", "--", "src", "bench") else "")


def save(report: dict[str, Any], out: str, stem: str) -> Path:
    """Write REPORT as JSON to OUT: a file, or `auto` for bench/results/<stem>_<report's date>.json."""
    path = RESULTS / f"{stem}_{report['date']}.json" if out == "auto" else Path(out)
    path.write_text(json.dumps(report, indent=1) + "\n")
    return path

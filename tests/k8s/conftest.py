"""Fixtures of the Kubernetes tests: the CRD schema folder, a small API server on 127.0.0.1 (apiserver.py), the
CLI run in this process, and the helm binary."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.k8s.apiserver import ApiServer

SHARED_CRDS = Path(__file__).resolve().parents[3] / "shared" / "k8s" / "crds"  # beside the checkout


@pytest.fixture(scope="session")
def crd_folder() -> Path:
    """The CRD copies in ../shared/k8s/crds: skipped on a fresh clone, a failure under CI (where they are)."""
    if SHARED_CRDS.is_dir():
        return SHARED_CRDS
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true but the CRD copies are missing at {SHARED_CRDS}")
    pytest.skip(f"needs the CRD copies at {SHARED_CRDS} (absent on a fresh clone)")


@pytest.fixture(scope="session")
def crd_schemas(crd_folder: Path) -> dict[tuple[str, str], dict[str, Any]]:
    from kubetrain.k8s.render.validate import folder_schemas

    return folder_schemas(crd_folder)


@pytest.fixture
def apiserver() -> Iterator[ApiServer]:
    server = ApiServer()
    yield server
    server.close()


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., tuple[int, str, str]]:
    """Run `kubetrain ...` in this process: (exit code, stdout, stderr)."""
    from kubetrain.cli import main

    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        try:
            main(list(args))
            code = 0
        except SystemExit as e:
            code = int(e.code or 0)
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture(scope="session")
def helm_binary() -> str:
    from tests.k8s.helm_run import find_helm

    return find_helm()

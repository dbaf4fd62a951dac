"""Fixtures of the Kubernetes tests: the CRD schema folder."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def crd_folder() -> Path:
    """The CRD schemas (../shared/k8s/crds); a missing folder fails the test with the places looked at."""
    from kubetrain.k8s.validate import crd_dir

    return crd_dir()

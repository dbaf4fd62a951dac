"""kubetrain installed from a built wheel (not editable), used with no repository around it: it trains on its
embedded corpus, renders custom resources, and reads nothing outside its own install (no ../shared)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from this checkout, installed (without dependencies: they are this venv's) into a folder."""
    build = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(build), str(ROOT)], check=True, capture_output=True, timeout=300)
    wheel = next(build.glob("kubetrain-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "kubetrain/presets/tiny.yaml" in names and any(n.startswith("kubetrain/data/corpus/") for n in names)
    site = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    return site


def run_installed(site: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBETRAIN_")}
    env.update({"PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_the_installed_package_trains_and_renders_without_the_repository(installed: Path, tmp_path: Path) -> None:
    where = run_installed(installed, tmp_path, "-c", "import kubetrain; print(kubetrain.__file__)")
    assert where.stdout.strip().startswith(str(installed)), where.stdout + where.stderr

    trained = run_installed(installed, tmp_path, "-m", "kubetrain", "train", "--preset", "tiny",
                            "--set", "train.max_steps=2", "--set", "model.n_layer=1", "--set", "model.n_embd=32",
                            "--set", "eval.every_steps=2", "--set", "eval.sample_tokens=4", "--set", "run.threads=1")
    assert trained.returncode == 0, trained.stderr
    assert "run directory:" in trained.stdout and (tmp_path / "runs" / "tiny" / "checkpoints" / "latest").is_file()

    for workload in ("jobset", "trainjob", "pytorchjob"):
        rendered = run_installed(installed, tmp_path, "-m", "kubetrain", "k8s", "render", "--preset", "tiny",
                                 "--workload", workload)
        assert rendered.returncode == 0, rendered.stderr
        assert "kind: " in rendered.stdout and "schema" in rendered.stderr  # one line: CRs were not checked
        assert len(rendered.stderr.strip().splitlines()) == 1, rendered.stderr

    # the platform: its Grafana dashboard ships inside the package (no deploy/ around an installed kubetrain)
    platform = run_installed(installed, tmp_path, "-m", "kubetrain", "k8s", "platform", "render", "--no-validate")
    assert platform.returncode == 0, platform.stderr
    assert "grafana_dashboard" in platform.stdout and '"uid": "kubetrain"' in platform.stdout

"""scripts/bundle: the wheels an air-gapped GPU node needs (downloaded for real from the package index), and
their install with no index in a clean virtual environment, followed by the quick self-test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCH_WHEEL = Path("/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl")
# torch 2.13's own requirements, which an image with torch has
TORCH_NEEDS = ["setuptools>=77.0.3", "filelock", "typing-extensions>=4.10.0", "sympy>=1.13.3", "networkx>=2.5.1",
               "jinja2", "fsspec>=0.8.5"]

# a download, a clean environment and a self-test: minutes on a shared machine, more than the suite's default limit
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def bundle(out: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bundle"), "-o", str(out), *args],
                          capture_output=True, text=True, timeout=1200, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def pip_env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "PIP_CACHE_DIR": str(tmp_path / "pip-cache"), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


@pytest.mark.ci  # a heavy end-to-end proof (many processes): .ci/run runs it, not the README's test command
def test_the_default_bundle_is_small_and_holds_what_the_gpu_image_lacks(tmp_path: Path) -> None:
    out = tmp_path / "bundle"
    proc = bundle(out, env=pip_env(tmp_path))
    wheels = sorted(p.name for p in out.glob("*.whl"))
    size = sum(p.stat().st_size for p in out.iterdir())
    assert size < 64 * 2**20, f"{size / 2**20:.1f} MiB"
    assert any(w.startswith("kubetrain-0") for w in wheels)
    assert any(w.startswith("pydantic_core-") and "-cp312-cp312-manylinux" in w for w in wheels), wheels
    assert any(w.startswith("pydantic-") for w in wheels) and any(w.startswith("gguf-") for w in wheels)
    # what an image with torch, transformers and peft has is left out
    assert not [w for w in wheels if w.split("-")[0] in ("torch", "transformers", "peft", "numpy", "safetensors")]
    assert os.access(out / "install", os.X_OK) and "--no-index" in (out / "install").read_text()
    meta = json.loads((out / "bundle.json").read_text())
    assert meta["python"] == "3.12" and meta["top"] == ["kubetrain", "gguf"] and "MiB" in proc.stdout


@pytest.mark.ci  # an install from the bundle and the quick check (80 s); tests/selftest runs the check (CI's stage)
@pytest.mark.skipif(not TORCH_WHEEL.is_file(), reason=f"needs the local torch wheel {TORCH_WHEEL}")
def test_the_bundle_installs_with_no_index_and_the_quick_check_passes(tmp_path: Path) -> None:
    env = pip_env(tmp_path)
    out = tmp_path / "bundle"
    bundle(out, "--python", f"{sys.version_info.major}.{sys.version_info.minor}", "--image", "torch", env=env)
    # the "image": a clean virtual environment with torch and its requirements, and nothing of kubetrain's
    image_wheels = tmp_path / "image-wheels"
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "-d", str(image_wheels),
                    *TORCH_NEEDS], check=True, env=env, timeout=600)
    venv = tmp_path / "node"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    offline = {**env, "PIP_CONFIG_FILE": os.devnull, "PYTHONPATH": "", "PATH": f"{venv / 'bin'}:{os.environ['PATH']}"}
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-index", "--no-compile", "--find-links",
                    str(image_wheels), str(TORCH_WHEEL)], check=True, env=offline, timeout=900)
    check = tmp_path / "check.json"
    # two groups: what the bundle lacks (hf) and a training run that resumes; the whole check runs in tests/selftest
    proc = subprocess.run([str(out / "install"), "--", "--quick", "--only", "correctness,hf", "-o", str(check)],
                          capture_output=True, text=True,
                          env={**offline, "PYTHON": str(py)}, timeout=1800, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(check.read_text())
    status = {item["name"]: item for item in report["items"]}
    # transformers and peft are not in this image nor in the bundle: those items say so
    assert report["groups"] == ["correctness", "hf"] and "speed.reference" not in status
    assert status["hf.lora_bf16"]["status"] == "skipped" and "transformers" in status["hf.lora_bf16"]["why"]
    assert status["correctness.resume"]["status"] == "passed" and report["ok"]
    installed = subprocess.run([str(py), "-c", "import kubetrain, pydantic_core, gguf; print(kubetrain.__file__)"],
                               capture_output=True, text=True, env=offline, check=True, timeout=300)
    assert str(venv) in installed.stdout  # the bundle's kubetrain, not this checkout's

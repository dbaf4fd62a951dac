"""Shared fixtures: a tiny model config, a temporary working directory, and the real CLI in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytest_plugins = ["tests.hf_models", "tests.object_store"]  # tiny HF models and chat; the S3 server

SRC = Path(__file__).resolve().parents[1] / "src"

# Tests never reach a model hub. Set before anything imports huggingface_hub, which reads it once.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RunMain = Callable[..., tuple[int, str, str]]  # run_main(*args) -> (exit code, stdout, stderr)
Cli = Callable[..., "subprocess.CompletedProcess[str]"]  # cli(*args) -> the finished process

# A 1-layer model that trains in about a second on one thread; tests add their own --set on top.
TINY = [
    "run.threads=1",
    "model.n_layer=1",
    "model.n_head=2",
    "model.n_embd=32",
    "model.block_size=32",
    "train.max_steps=6",
    "train.micro_batch_size=4",
    "train.warmup_steps=2",
    "train.log_every_steps=1",
    "eval.every_steps=3",
    "eval.windows=2",
    "eval.sample_tokens=8",
    "checkpoint.every_steps=3",
]


@pytest.fixture
def tiny_args() -> list[str]:
    """`--set` arguments for a tiny model run (one thread, a few steps)."""
    return [arg for kv in TINY for arg in ("--set", kv)]


@pytest.fixture(autouse=True)
def _empty_working_folder(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test starts in an empty folder of its own: what the checkout holds (a `runs/` left by the README's
    first command) never changes a result, and nothing a test writes by a relative path lands in the checkout."""
    folder = tmp_path_factory.mktemp("cwd")
    monkeypatch.chdir(folder)
    return folder


@pytest.fixture
def tmp_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run the test inside an empty folder, so `runs/` and caches land there."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def cli_env(**extra: str) -> dict[str, str]:
    """The environment for a `python -m kubetrain` subprocess that imports this checkout's source first."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update({"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"})
    env.pop("KUBETRAIN_DEBUG", None)
    env.update(extra)
    return env


@pytest.fixture
def cli(tmp_cwd: Path) -> Cli:
    """Run `python -m kubetrain ARGS...` for real in the temporary folder; returns the CompletedProcess."""

    def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "kubetrain", *args],
            cwd=tmp_cwd, env=cli_env(), capture_output=True, text=True, timeout=timeout, check=False,
        )

    return run


@pytest.fixture
def run_main(capsys: pytest.CaptureFixture[str]) -> RunMain:
    """Call the real entry point `kubetrain.cli.main(ARGS)` in this process: (exit code, stdout, stderr)."""
    from kubetrain.cli import main

    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        with pytest.raises(SystemExit) as exited:
            main(list(args))
        out, err = capsys.readouterr()
        code = exited.value.code
        return (code if isinstance(code, int) else 0 if code is None else 1), out, err

    return run


def assert_same_weights(mine: Path, theirs: Path) -> None:
    """Two safetensors files hold the same tensors, bit for bit: only for two files written on this machine."""
    from safetensors.torch import load_file

    a, b = load_file(mine), load_file(theirs)
    assert a.keys() == b.keys()
    for name, tensor in b.items():
        assert a[name].equal(tensor), f"{name} differs"


def assert_close_weights(mine: Path, theirs: Path, atol: float) -> None:
    """Two safetensors files hold the same tensors within `atol`: for a reference written on another machine.

    CPU kernels differ by instruction set (AVX2 against AVX-512), so bits hold only on one machine.
    """
    from safetensors.torch import load_file

    a, b = load_file(mine), load_file(theirs)
    assert a.keys() == b.keys()
    for name, tensor in b.items():
        assert a[name].shape == tensor.shape and a[name].dtype == tensor.dtype, name
        largest = (a[name].float() - tensor.float()).abs().max().item()
        assert largest <= atol, f"{name} differs by up to {largest:.3g} (tolerance {atol:g})"

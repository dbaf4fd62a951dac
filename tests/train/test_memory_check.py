"""A model too big for the memory here is refused before it is built: one line with the estimate and what
to change, exit 2 (dry runs and `--nproc` launchers too); run.check_memory=false lets it start anyway."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

from kubetrain.config import load_config
from kubetrain.errors import EXIT_BAD_INPUT, UserInputError
from kubetrain.train.memory_check import check_memory
from tests.conftest import cli_env

# About 400 GiB to train by doctor's estimate (26B parameters): more than any machine that runs these tests.
HUGE = ["model.n_layer=8", "model.n_embd=16384", "model.n_head=128"]
GUARD = 6 * 2**30  # address space of the CLI under test: a missing check fails fast here, not by the OOM killer


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (GUARD, GUARD))


def _train(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    sets = [a for kv in HUGE for a in ("--set", kv)]
    return subprocess.run([sys.executable, "-m", "kubetrain", "train", *sets, *args], cwd=tmp_path, env=cli_env(),
                          capture_output=True, text=True, timeout=300, preexec_fn=_limited, check=False)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--dry-run"], ["--nproc", "2"]])
def test_a_model_too_big_is_refused_in_one_line_before_it_is_built(tmp_path: Path, extra: list[str]) -> None:
    done = _train(tmp_path, *extra)
    assert done.returncode == EXIT_BAD_INPUT, done.stderr[-2000:]
    assert done.stderr.startswith("error: this run needs about ") and done.stderr.count("\n") == 1
    assert "25,782,665,216 parameters" in done.stderr and "set run.check_memory=false" in done.stderr
    assert not (tmp_path / "runs").exists()  # nothing written, no run directory left behind


def test_the_estimate_names_what_to_change() -> None:
    cfg = load_config(None, None, HUGE)
    with pytest.raises(UserInputError, match=r"optimizer 192\.1.*use a smaller model, train LoRA adapters"):
        check_memory(cfg)
    long_context = load_config(None, None, ["model.block_size=65536", "train.micro_batch_size=64"])
    with pytest.raises(UserInputError, match=r"lower train\.micro_batch_size .* model\.gradient_checkpointing"):
        check_memory(long_context)


def test_check_memory_false_lets_it_start_and_a_small_model_passes() -> None:
    check_memory(load_config(None, None, [*HUGE, "run.check_memory=false"]))
    check_memory(load_config(None, None, []))  # the tiny preset

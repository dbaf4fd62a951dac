"""A model too big for the memory here is refused before it is built: one line with the estimate and what
to change, exit 2 (dry runs and `--nproc` launchers too); run.check_memory=false lets it start anyway."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kubetrain.config import load_config
from kubetrain.errors import EXIT_BAD_INPUT, UserInputError
from kubetrain.train.memory_check import GIB, check_memory
from tests.conftest import cli_env

# About 400 GiB to train by doctor's estimate (26B parameters): more than any machine that runs these tests.
HUGE = ["model.n_layer=8", "model.n_embd=16384", "model.n_head=128"]
GUARD = 6 * 2**30  # address space of the CLI under test: a missing check fails fast here, not by the OOM killer


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (GUARD, GUARD))


def _train(tmp_path: Path, *args: str, model: list[str] = HUGE, guard: bool = True
           ) -> subprocess.CompletedProcess[str]:
    sets = [a for kv in model for a in ("--set", kv)]
    return subprocess.run([sys.executable, "-m", "kubetrain", "train", *sets, *args], cwd=tmp_path, env=cli_env(),
                          capture_output=True, text=True, timeout=300, preexec_fn=_limited if guard else None,
                          check=False)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--dry-run"], ["--nproc", "2"]])
def test_a_model_too_big_is_refused_in_one_line_before_it_is_built(tmp_path: Path, extra: list[str]) -> None:
    done = _train(tmp_path, *extra)
    assert done.returncode == EXIT_BAD_INPUT, done.stderr[-2000:]
    launcher = "--nproc 2: " if "--nproc" in extra else ""  # the launcher's refusal names the process count first
    assert done.stderr.startswith(f"error: {launcher}this run needs about ") and done.stderr.count("\n") == 1
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


# 476,181,760 parameters (the tiny preset's byte vocabulary): per process 9.4 GiB under DDP, 2.5 GiB under FSDP
GPT_476M = ["model.n_layer=24", "model.n_embd=1280", "model.n_head=20", "train.micro_batch_size=2"]


@pytest.mark.ci  # 4 processes (19 s); the estimate's unit tests count FSDP and DDP (CI's stage)
@pytest.mark.slow
def test_a_476m_gpt_on_4_processes_is_accepted_under_fsdp_and_refused_under_ddp(tmp_path: Path) -> None:
    # each worker checking as one process, with the launcher multiplying that by --nproc, would refuse FSDP
    # ("needs about 30.4 GiB") on a machine where it fits
    from kubetrain.hardware import device_info
    from kubetrain.memory import Layout, estimate_on

    free = device_info(torch.device("cpu")).memory_free or 0
    needs = {}
    for strategy in ("ddp", "fsdp"):
        cfg = load_config(None, None, [*GPT_476M, f"dist.strategy={strategy}"])
        est = estimate_on(cfg, Layout.of(cfg, 4, 4), torch.device("cpu"))
        assert not isinstance(est, str)
        needs[strategy] = est.device_need
    if not needs["fsdp"] <= free < needs["ddp"]:
        pytest.skip(f"{free / 2**30:.1f} GiB free: the two runs are told apart between "
                    f"{needs['fsdp'] / 2**30:.1f} and {needs['ddp'] / 2**30:.1f} GiB")
    ddp = _train(tmp_path, "--nproc", "4", "--oversubscribe", "--set", "dist.strategy=ddp", "--dry-run",
                 model=GPT_476M)
    assert ddp.returncode == EXIT_BAD_INPUT and ddp.stderr.count("\n") == 1, ddp.stderr[-2000:]
    assert ddp.stderr.startswith(f"error: --nproc 4: this run needs about {needs['ddp'] / 2**30:.1f} GiB")
    assert "per process of 4 (ddp), x4 processes on this node" in ddp.stderr
    # FSDP: the launcher and its 4 workers accept; the workers then stop at the data (a path that is not there)
    # rather than spend minutes building 476M parameters on this CPU for the dry run's forward pass
    missing = f"data.sources=[{{kind: text, path: {tmp_path / 'missing.txt'}}}]"
    fsdp = _train(tmp_path, "--nproc", "4", "--oversubscribe", "--set", "dist.strategy=fsdp", "--set", "run.threads=1",
                  "--set", missing, "--dry-run", model=GPT_476M, guard=False)
    # the first worker to fail is refused by the data, not by the memory check, and the agent stops the others
    # (exit 2, or 1 when it names a rank it had to stop before that rank's own exit)
    assert fsdp.returncode in (1, EXIT_BAD_INPUT) and "needs about" not in fsdp.stderr, fsdp.stderr[-2000:]
    assert "error: data path not found" in fsdp.stderr


def test_a_measured_peak_is_put_beside_the_estimate_and_warns_past_15_percent() -> None:
    from kubetrain.train.memory_check import peak_against_estimate

    line, off = peak_against_estimate(8 * GIB, int(8.4 * GIB))
    assert line == "memory: peak 8.00 GiB measured, 8.40 GiB estimated (estimate / measured 1.05)" and not off
    assert peak_against_estimate(10 * GIB, int(8.4 * GIB))[1]  # under by 16%: a run it said fits may not
    assert peak_against_estimate(8 * GIB, int(9.3 * GIB))[1]  # over by 16%: it refuses runs that fit
    assert not peak_against_estimate(10 * GIB, int(8.6 * GIB))[1]

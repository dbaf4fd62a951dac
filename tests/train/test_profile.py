"""`train.profile`: the real trainer traces the steps asked for into <run>/profile/ (a Chrome trace that parses, a
table of real ops), on rank 0 only by default, and nothing without it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kubetrain.config import load_config
from kubetrain.errors import UserInputError
from kubetrain.train.profile import StepProfiler, sort_key, window
from kubetrain.train.trainer import train
from tests.train.conftest import TINY, kubetrain, sets


def test_the_window_warms_up_on_the_step_before_the_first_traced_one() -> None:
    assert window(5) == (3, 1)  # steps 1-3 untraced, 4 warms the profiler up, 5 is traced
    assert window(2) == (0, 1)
    assert window(1) == (0, 0)  # the first step itself: no step before it to warm up on
    assert sort_key("cuda") == "self_device_time_total" and sort_key("cpu") == "self_cpu_time_total"


def _trace_names(trace: Path) -> set[str]:
    data = json.loads(trace.read_text())
    assert data["traceEvents"], "an empty trace"
    return {e.get("name", "") for e in data["traceEvents"]}


def test_a_run_traces_the_steps_asked_for(workdir: Path) -> None:
    cfg = load_config(None, None, [*TINY, "run.name=p", "train.max_steps=4", "train.profile.start=2",
                                   "train.profile.steps=2", "eval.every_steps=4"])
    said: list[str] = []
    train(cfg, log=said.append)
    folder = workdir / "runs" / "p" / "profile"
    assert sorted(p.name for p in folder.iterdir()) == ["ops-rank0-steps-2-3.txt", "trace-rank0-steps-2-3.json"]
    names = _trace_names(folder / "trace-rank0-steps-2-3.json")
    assert {"aten::mm", "aten::logsumexp"} <= names  # the GEMMs and the loss (its chunks' log-sum-exp)
    assert sum(n.startswith("ProfilerStep#") for n in names) == 2  # two traced steps (not the warm-up)
    table = (folder / "ops-rank0-steps-2-3.txt").read_text()
    assert table.startswith("steps 2-3 of rank 0 on cpu, sorted by self_cpu_time_total")
    assert "aten::mm" in table and "Self CPU" in table
    assert "profiling steps 2-3 on rank 0 into runs/p/profile" in said
    assert "profile of steps 2-3: runs/p/profile/trace-rank0-steps-2-3.json (open it in ui.perfetto.dev), top ops " \
           "in runs/p/profile/ops-rank0-steps-2-3.txt" in said


@pytest.mark.slow
@pytest.mark.ci  # a heavy end-to-end proof (many processes): .ci/run runs it, not the README's test command
def test_a_run_that_ends_first_writes_the_steps_it_traced_and_none_is_off(tmp_path: Path) -> None:
    kubetrain("train", *sets("run.name=short", "train.max_steps=2", "train.profile={start: 2, steps: 5}",
                             "eval.every_steps=2"), cwd=tmp_path)
    folder = tmp_path / "runs" / "short" / "profile"
    assert sorted(p.name for p in folder.iterdir()) == ["ops-rank0-steps-2-2.txt", "trace-rank0-steps-2-2.json"]
    assert "aten::mm" in _trace_names(folder / "trace-rank0-steps-2-2.json")
    kubetrain("train", *sets("run.name=off", "train.max_steps=2", "eval.every_steps=2"), cwd=tmp_path)
    assert not (tmp_path / "runs" / "off" / "profile").exists()
    late = kubetrain("train", *sets("run.name=late", "train.max_steps=2", "train.profile.start=5",
                                    "eval.every_steps=2"), cwd=tmp_path)
    assert "profile: the run stopped at step 2, before step 5; nothing was traced" in late.stdout
    assert not (tmp_path / "runs" / "late" / "profile").exists()


@pytest.mark.slow
def test_under_two_processes_only_rank_0_traces_by_default(tmp_path: Path) -> None:
    # with micro_batch_size auto too: both ranks agree on the micro-batch (the smaller choice) before the first step;
    # 2 GiB holds micro-batch 8 with what each process holds before its first tensor
    done = kubetrain("train", *sets("run.name=two", "train.max_steps=3", "train.profile={start: 2, steps: 1}",
                                    "eval.every_steps=3", "train.micro_batch_size=auto",
                                    "train.global_batch_size=16", "train.memory_budget_gib=2"),
                     "--nproc", "2", cwd=tmp_path)
    folder = tmp_path / "runs" / "two" / "profile"
    assert sorted(p.name for p in folder.iterdir()) == ["ops-rank0-steps-2-2.txt", "trace-rank0-steps-2-2.json"]
    assert "aten::mm" in _trace_names(folder / "trace-rank0-steps-2-2.json")
    out = done.stdout + done.stderr
    assert "micro-batch 8 x 1 accum x 2 processes = global batch 16 (auto: the largest of 8, 4, 2, 1" in out
    assert "profiling steps 2-2 on rank 0" in out and "on rank 1" not in out


def test_a_profile_folder_that_cannot_be_written_is_a_warning_and_the_run_goes_on(workdir: Path) -> None:
    """A trace is a diagnostic: a file where its folder should be costs the trace, never the run."""
    (workdir / "runs" / "blocked").mkdir(parents=True)
    (workdir / "runs" / "blocked" / "profile").write_text("in the way")
    cfg = load_config(None, None, [*TINY, "run.name=blocked", "train.max_steps=3", "train.profile.start=1",
                                   "train.profile.steps=1", "eval.every_steps=3"])
    said: list[str] = []
    result = train(cfg, log=said.append)
    assert result.steps == 3
    warned = [line for line in said if line.startswith("profile: warning: ")]
    assert warned and "runs/blocked/profile" in warned[0] and "the run goes on" in warned[0], said
    assert not any("before step" in line for line in said)  # no claim that the run stopped before it was traced


@pytest.mark.parametrize(("ranks", "world"), [([5], 2), ([0, 2], 2), ([1], 1)])
def test_a_rank_the_job_does_not_have_is_one_line(tmp_path: Path, ranks: list[int], world: int) -> None:
    """ranks: [5] at world size 2 would trace nothing, silently; every rank refuses it alike."""
    cfg = load_config(None, None, [*TINY, f"train.profile.ranks={ranks}"]).train.profile
    for rank in range(world):
        with pytest.raises(UserInputError, match=r"^train\.profile\.ranks: no rank \d") as e:
            StepProfiler.for_rank(cfg, tmp_path, rank, torch.device("cpu"), 0, world_size=world)
        assert f"ranks 0-{world - 1}" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "profile").exists()

"""Stragglers named at log steps: the arithmetic, the timer, and a worker slowed by a stop/continue loop."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from kubetrain.errors import EXIT_STOPPED_RESUMABLE
from kubetrain.train.straggler import ComputeTimer, Stragglers
from tests.train.conftest import children, lines_in, rank_of, sets, start, wait_until


def test_the_slowest_rank_is_compared_with_the_median_of_the_others() -> None:
    s = Stragglers.of([1.0, 3.0, 1.2, 0.9])
    assert s.slowest_rank == 1 and s.ratio == pytest.approx(3.0 / 1.0)  # median of 1.0, 1.2, 0.9
    assert Stragglers.of([0.0, 0.0]).ratio == 1.0
    assert s.record()["rank_compute_seconds"] == [1.0, 3.0, 1.2, 0.9]
    # two ranks: over the other one, not over their mean (which capped the ratio below 2)
    two = Stragglers.of([1.0, 1.5])
    assert (two.slowest_rank, two.ratio, two.ratios) == (1, 1.5, [pytest.approx(1 / 1.5), 1.5])
    four = Stragglers.of([1.0, 1.0, 1.5, 1.0])
    assert (four.slowest_rank, four.ratio) == (2, 1.5) and four.ratios[0] == 1.0


class Clock:
    """time.perf_counter for the timer, moved by hand: what is counted is exact, whatever the machine's load."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_timer_counts_data_wait_and_forward_not_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr("kubetrain.train.straggler.time.perf_counter", clock)
    model = nn.Linear(4, 4)
    model.register_forward_hook(lambda *_: setattr(clock, "now", clock.now + 0.03))  # the forward takes 0.03 s
    timer = ComputeTimer(torch.device("cpu"), model)
    timer.start()
    clock.now += 0.05  # waiting for data
    timer.batch_ready()
    clock.now += 0.2  # e.g. DDP's buffer broadcast, before the module's own forward: not counted
    model(torch.zeros(1, 4))
    timer.stop()
    clock.now += 0.1  # backward and the collective: not counted
    assert timer.window() == pytest.approx(0.08)
    assert timer.window() == 0.0  # a fresh window
    assert timer.gather() is None  # one process: nothing to compare


@pytest.mark.slow
@pytest.mark.ci  # a heavy end-to-end proof (many processes): .ci/run runs it, not the README's test command
def test_a_worker_stopped_and_continued_in_a_loop_is_named_the_slowest_rank(tmp_path: Path) -> None:
    proc = start("train", *sets("run.name=slow", "train.max_steps=100000", "checkpoint.every_steps=100000",
                                "eval.every_steps=100000", "train.log_every_steps=5", "train.grad_accum_steps=4"),
                 "--nproc", "3", "--oversubscribe", cwd=tmp_path)
    metrics = tmp_path / "runs" / "slow" / "metrics.jsonl"
    wait_until(lambda: lines_in(metrics) >= 2, proc)
    target = next(pid for pid in children(proc.pid) if rank_of(pid) == 1)
    done, stopping = threading.Event(), threading.Event()

    def stop_and_continue() -> None:
        pace = random.Random(0)  # random lengths: a fixed period can lock onto the step and hit only the backward
        while not done.is_set():
            os.kill(target, signal.SIGSTOP)
            stopping.set()
            time.sleep(pace.uniform(0.03, 0.06))
            os.kill(target, signal.SIGCONT)
            time.sleep(pace.uniform(0.005, 0.015))

    loop = threading.Thread(target=stop_and_continue)
    loop.start()
    try:
        # Counted from the first stop, not from the thread's start: on a loaded machine a whole logging window
        # can pass before the thread first runs, and that window would then count as a slowed one.
        wait_until(stopping.is_set, proc)
        slowed_from = lines_in(metrics)
        wait_until(lambda: lines_in(metrics) >= slowed_from + 6, proc)
    finally:
        done.set()
        loop.join()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_STOPPED_RESUMABLE
    # a stop that was asked for is no error: one line, from global rank 0, naming the step and the checkpoint
    stopped = [line for line in err.splitlines() if "stopped by SIGTERM" in line]
    assert len(stopped) == 1 and "error" not in err, err[-3000:]
    assert re.fullmatch(r"stopped by SIGTERM at step \d+; checkpoint step-\d+; resume with the same command",
                        stopped[0]), stopped
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert all({"slowest_rank", "straggler_ratio", "rank_compute_seconds"} <= set(r) for r in train)
    # the first slowed window may straddle the start of the loop
    slowed = [r for r in records[slowed_from + 1:slowed_from + 6] if r["kind"] == "train"]
    named = [r["slowest_rank"] for r in slowed]
    assert named.count(1) >= len(named) - 1, slowed
    assert max(r["straggler_ratio"] for r in slowed) > 1.5, slowed

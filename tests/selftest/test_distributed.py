"""`doctor --check --nproc N`'s link test (selftest/distributed.py `links`): the job's preflight, run for real."""

from __future__ import annotations

from pathlib import Path

import pytest

from kubetrain.selftest.context import Context
from kubetrain.selftest.distributed import links


def test_one_process_has_no_links_to_measure(tmp_path: Path) -> None:
    outcome = links(Context(device="cpu", quick=True, work=tmp_path))
    assert outcome.status == "skipped" and "--nproc N" in outcome.why


@pytest.mark.slow
def test_two_processes_measure_their_links_and_name_no_rank(tmp_path: Path) -> None:
    outcome = links(Context(device="cpu", quick=True, work=tmp_path, nproc=2))
    assert outcome.status == "passed", outcome.why
    figures = outcome.figures
    assert figures["world_size"] == 2 and figures["backend"] == "gloo" and figures["problems"] == []
    assert figures["median_all_reduce_busbw_gb_per_s"] > 0 and figures["median_link_gb_per_s"] > 0
    assert set(figures["latency_ms"]) == {0, 1}

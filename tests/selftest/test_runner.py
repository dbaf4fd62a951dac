"""`kubetrain doctor --check`: every item reported with a status, why and figures; a group that dies fails its items."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from kubetrain.selftest import GROUPS, STATUSES
from kubetrain.selftest.context import Context
from kubetrain.selftest.runner import run_group
from tests.conftest import Cli

ITEM_KEYS = {"name", "status", "why", "figures", "tolerance", "seconds"}


@pytest.mark.slow
@pytest.mark.timeout(1200)  # about 70 s of CPU; a loaded shared machine stretches it past the suite's default limit
@pytest.mark.ci  # a heavy end-to-end proof (many processes): .ci/run runs it, not the README's test command
def test_quick_check_on_the_cpu_reports_every_item(cli: Cli, tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    proc = cli("doctor", "--check", "--quick", "--json", "-o", str(out), timeout=900)
    report = json.loads(out.read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == report
    assert proc.returncode == (0 if report["ok"] else 1), proc.stderr
    assert report["mode"] == "quick" and report["device"]["kind"] == "cpu" and report["versions"]["torch"]
    items = report["items"]
    assert [i["name"] for i in items] == [name for names in GROUPS.values() for name in names]
    for item in items:
        assert set(item) == ITEM_KEYS and item["status"] in STATUSES and item["why"], item
        if item["status"] != "skipped":
            assert item["figures"] and item["tolerance"], item
    assert report["summary"] == {s: sum(i["status"] == s for i in items) for s in STATUSES}
    assert report["ok"] == (report["summary"]["failed"] == 0)
    # on the CPU only what needs CUDA is skipped, each with why, and the link test without --nproc; the rest ran
    status = {i["name"]: i for i in items}
    skipped = {name for name, i in status.items() if i["status"] == "skipped"}
    assert skipped == {"correctness.cpu_match", "correctness.fp16", "speed.compiled", "memory.oom",
                       "distributed.links"}, skipped
    estimate = status["memory.estimate"]  # judged on the CPU too: doctor's estimate against the resident peak
    assert 0.85 <= estimate["figures"]["estimate_over_measured"] <= 1.15, estimate
    assert status["correctness.resume"]["figures"]["bitwise_losses"] is True
    assert "passed" in proc.stderr  # each item's line, as it finished


def test_a_group_that_does_not_finish_fails_each_of_its_items(tmp_path: Path) -> None:
    ctx = Context(device="cpu", quick=True, work=tmp_path)
    started = time.monotonic()
    outcomes = run_group("correctness", ctx, timeout=0.5)
    assert time.monotonic() - started < 60
    assert [o.name for o in outcomes] == list(GROUPS["correctness"])
    assert all(o.status == "failed" and "did not finish within 0s" in o.why for o in outcomes)


def test_a_group_that_cannot_run_here_is_skipped_without_a_process(tmp_path: Path) -> None:
    outcomes = run_group("memory", Context(device="mps", quick=True, work=tmp_path), timeout=0.01)
    assert [(o.name, o.status) for o in outcomes] == [("memory.estimate", "skipped"), ("memory.oom", "skipped")]
    assert all("CUDA and CPU only" in o.why for o in outcomes)

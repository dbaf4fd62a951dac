"""`kubetrain doctor [CONFIG]` through the real entry point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kubetrain.memory import LAUNCHER_RUNTIME
from tests.conftest import RunMain


def test_doctor_prints_the_machine(run_main: RunMain) -> None:
    code, out, err = run_main("doctor")
    assert (code, err) == (0, "")
    assert out.startswith("device: ") and "  math: ok" in out


def test_doctor_json_with_a_config(run_main: RunMain) -> None:
    code, out, _ = run_main("doctor", "--preset", "tiny", "--set", "run.device=cpu", "--json")
    assert code == 0
    report = json.loads(out.strip().splitlines()[-1])
    assert report["settings"]["device"] == "cpu" and report["fit"]["fits"] in (True, False)


def test_doctor_with_a_bad_config_is_one_error_line(run_main: RunMain) -> None:
    code, out, err = run_main("doctor", "--set", "train.lrr=1")
    assert (code, out) == (2, "")
    assert err.startswith("error: --set: unknown key 'train.lrr'") and err.count("\n") == 1


def test_doctor_estimates_per_process_of_a_sharded_world(run_main: RunMain) -> None:
    args = ("doctor", "--preset", "tiny", "--set", "run.device=cpu", "--set", "dist.strategy=fsdp", "--json")
    one = json.loads(run_main(*args)[1].strip().splitlines()[-1])["fit"]
    code, out, _ = run_main(*args, "--nproc", "4", "--oversubscribe")  # more processes than a 2-core CI has
    four = json.loads(out.strip().splitlines()[-1])["fit"]
    assert code == 0 and (four["world_size"], four["strategy"]) == (4, "fsdp")
    assert four["parts"]["optimizer"] < one["parts"]["optimizer"]
    # --nproc: per node, beside their launcher (each rank stages its own FSDP shards)
    assert four["local_processes"] == 4 and four["device_need"] == 4 * four["estimate"] + LAUNCHER_RUNTIME
    code, out, _ = run_main(*args, "--nproc", "4", "--nnodes", "2", "--oversubscribe")
    eight = json.loads(out.strip().splitlines()[-1])["fit"]
    assert (eight["world_size"], eight["local_processes"], eight["shards"]) == (8, 4, 8)
    assert eight["parts"]["optimizer"] < four["parts"]["optimizer"]


def test_doctor_check_takes_no_config(run_main: RunMain) -> None:
    code, out, err = run_main("doctor", "--check", "--preset", "tiny")
    assert (code, out) == (2, "")
    assert err.startswith("error: --check takes no CONFIG") and err.count("\n") == 1


def test_doctor_quick_needs_check(run_main: RunMain) -> None:
    code, _, err = run_main("doctor", "--quick")
    assert code == 2 and err.startswith("error: --quick, --output and --only go with --check")


@pytest.mark.slow  # the memory group trains on the CPU too (about a minute)
@pytest.mark.ci  # a heavy end-to-end proof (many processes): .ci/run runs it, not the README's test command
def test_doctor_check_only_runs_the_groups_named(run_main: RunMain, tmp_path: Path) -> None:
    code, _, err = run_main("doctor", "--check", "--only", "speed,nosuch")
    assert code == 2 and err.startswith("error: --only: no such group nosuch (groups: correctness, speed")
    assert err.count("\n") == 1
    out = tmp_path / "check.json"
    code, _, err = run_main("doctor", "--check", "--only", "memory", "-o", str(out))
    report = json.loads(out.read_text())
    assert code == 0 and report["groups"] == ["memory"] and report["ok"], err
    assert [(i["name"], i["status"]) for i in report["items"]] == [("memory.estimate", "passed"),
                                                                   ("memory.oom", "skipped")]

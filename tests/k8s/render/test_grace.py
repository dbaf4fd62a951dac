"""The grace period: the default rule, or the save time a local (or fetched) run of the config measured."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubetrain.config import load_config
from kubetrain.k8s.render.grace import (
    GRACE_MARGIN,
    SAVE_FACTOR,
    SAVE_MARGIN,
    MeasuredSave,
    measured_in,
    measured_locally,
    render_note,
)
from kubetrain.k8s.render.manifest import pod_templates, render
from kubetrain.track.console import checkpoint_in

Cli = Callable[..., tuple[int, str, str]]


def grace_of(objects: list[dict[str, Any]]) -> tuple[int, float, int]:
    """(terminationGracePeriodSeconds, the pods' checkpoint.grace_seconds, torchrun's shutdown wait)."""
    pod = pod_templates(objects[-1])[0][1]["spec"]
    pod_cfg = yaml.safe_load(objects[0]["data"]["config.yaml"])
    args = pod["containers"][0]["args"]
    return (pod["terminationGracePeriodSeconds"], pod_cfg["checkpoint"]["grace_seconds"],
            int(args[args.index("--shutdown-timeout") + 1]))


def write_metrics(run: Path, *saves: tuple[int, float]) -> None:
    run.mkdir(parents=True, exist_ok=True)
    lines = [{"kind": "train", "step": step, "loss": 3.0} for step, _ in saves]
    lines += [{"kind": "checkpoint", "step": step, "write_seconds": seconds, "blocked_seconds": 0.1}
              for step, seconds in saves]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_a_real_runs_save_sets_the_grace_and_render_stays_deterministic(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli: Cli, tiny_args: list[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    # a grace shorter than any save with its headroom, so the measurement is what decides
    sets = [*tiny_args, "--set", "checkpoint.grace_seconds=1"]
    code, out, err = cli("k8s", "render", *sets)
    assert code == 0, err
    before = yaml.safe_load_all(out)
    assert grace_of(list(before)) == (1 + GRACE_MARGIN, 1, 21)  # no run yet: the default rule

    code, out, err = cli("train", *sets)
    assert code == 0, err
    saves = [r for r in map(json.loads, (tmp_path / "runs/tiny/metrics.jsonl").read_text().splitlines())
             if r["kind"] == "checkpoint"]
    last = saves[-1]
    # the trainer's console line carries the same save, in the form k8s doctor reads back from a pod's log
    logged = [m for m in map(checkpoint_in, out.splitlines()) if m]
    assert [m[0] for m in logged] == [s["step"] for s in saves]
    assert logged[-1][1] == pytest.approx(last["write_seconds"], abs=0.006)

    needs = math.ceil(last["write_seconds"] * SAVE_FACTOR) + SAVE_MARGIN
    code, out, err = cli("k8s", "render", *sets)
    assert code == 0, err
    objects = list(yaml.safe_load_all(out))
    grace, pod_checkpoint_grace, shutdown = grace_of(objects)
    assert (grace, pod_checkpoint_grace) == (needs + GRACE_MARGIN, needs)
    assert needs <= shutdown < grace  # torchrun waits for the save, and exits before the kubelet kills the pod
    assert err.splitlines() == [f"note: terminationGracePeriodSeconds {grace} and checkpoint.grace_seconds {needs} in "
                                f"the pods follow the measured write {last['write_seconds']:.1f} s at step "
                                f"{last['step']} of runs/tiny"]
    assert cli("k8s", "render", *sets)[1] == out  # the same inputs render the same bytes


def test_phases_give_their_longest_newest_save(tmp_path: Path) -> None:
    run = tmp_path / "homelab"
    write_metrics(run, (100, 90.0), (200, 4.0))  # the newest save counts, not an older slow one
    write_metrics(run / "phases" / "pretrain", (100, 12.0))
    write_metrics(run / "phases" / "instruct", (50, 3.0))
    assert measured_in(run) == MeasuredSave(12.0, 100, str(run / "phases" / "pretrain"))
    assert measured_in(tmp_path / "nothing") is None
    write_metrics(tmp_path / "no-saves")
    assert measured_in(tmp_path / "no-saves") is None


def test_a_fetched_run_is_found_where_fetch_puts_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, "tiny", ["run.output_dir=/nonexistent/elsewhere"])
    assert measured_locally(cfg) is None
    write_metrics(tmp_path / "runs" / "tiny", (300, 40.0))  # `kubetrain k8s fetch tiny` puts it in runs/tiny
    measured = measured_locally(cfg)
    assert measured == MeasuredSave(40.0, 300, "runs/tiny")
    grace, pod_checkpoint_grace, _ = grace_of(render(cfg, measured=measured))
    assert (grace, pod_checkpoint_grace) == (60 + SAVE_MARGIN + GRACE_MARGIN, 60 + SAVE_MARGIN)  # 40 x 1.5 + 20


def test_a_longer_configured_grace_stands() -> None:
    cfg = load_config(None, "tiny", ["checkpoint.grace_seconds=120"])
    measured = MeasuredSave(10.0, 50, "runs/tiny")
    assert grace_of(render(cfg, measured=measured))[:2] == (150, 120)
    assert render(cfg, measured=measured) == render(cfg)  # nothing changes, nothing is said
    assert render_note(cfg, measured) is None


def test_an_explicit_grace_shorter_than_the_measured_save_is_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli: Cli
) -> None:
    monkeypatch.chdir(tmp_path)
    write_metrics(tmp_path / "runs" / "tiny", (400, 100.0))  # needs 150 + 20 + 30 = 200 s
    code, out, err = cli("k8s", "render", "--set", "k8s.grace_period_seconds=120")
    assert code == 0, err
    assert grace_of(list(yaml.safe_load_all(out))) == (120, 60, 110)  # the user's choice, both of them
    assert err.splitlines() == [
        "warning: k8s.grace_period_seconds (120) is shorter than the 200 s a save needs (measured write 100.0 s at "
        "step 400 of runs/tiny): a stopped pod may be killed mid-save and resume from the checkpoint before; raise "
        "it, or leave it unset to follow the measurement"]
    code, _, err = cli("k8s", "render", "--set", "k8s.grace_period_seconds=200")
    assert code == 0 and err == ""

"""k8s doctor's grace line: the grace launch renders and its origin; a save the job's pods logged that needs more."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.k8s.cluster.test_doctor import HOMELAB, cluster, doctor

Cli = Callable[..., tuple[int, str, str]]


def grace_line(out: str) -> str:
    return next(line for line in out.splitlines() if "grace:" in line)


def test_doctor_says_where_the_grace_comes_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, apiserver: Any, cli: Cli
) -> None:
    monkeypatch.chdir(tmp_path)
    kubeconfig = cluster(tmp_path, apiserver)
    code, out, err = doctor(cli, kubeconfig)
    assert code == 0, err
    assert grace_line(out) == ("ok    grace: terminationGracePeriodSeconds 90 s from the default rule: "
                               "checkpoint.grace_seconds 60 + 30")

    run = tmp_path / "runs" / "tiny"  # a fetched (or local) run of this config measured a 50 s save
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"kind": "checkpoint", "step": 800, "write_seconds": 50.0}) + "\n")
    code, out, _ = doctor(cli, kubeconfig)
    assert code == 0
    assert grace_line(out) == ("ok    grace: terminationGracePeriodSeconds 125 s from measured write 50.0 s at step "
                               "800 of runs/tiny (x1.5 + 20 s to finish the step, + 30 s for torchrun to exit)")
    code, out, _ = doctor(cli, kubeconfig, "k8s.grace_period_seconds=100")
    assert grace_line(out).startswith("warn  grace: terminationGracePeriodSeconds 100 s from "
                                      "k8s.grace_period_seconds; k8s.grace_period_seconds (100) is shorter than "
                                      "the 125 s a save needs (measured write 50.0 s at step 800 of runs/tiny)")


def test_a_save_the_running_job_logged_is_named_with_how_to_follow_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, apiserver: Any, cli: Cli
) -> None:
    monkeypatch.chdir(tmp_path)
    kubeconfig = cluster(tmp_path, apiserver)
    sets = [a for o in HOMELAB for a in ("--set", o)]
    code, _, err = cli("k8s", "launch", *sets, "--kubeconfig", kubeconfig)
    assert code == 0, err
    pod = apiserver.pod("tiny", 0)
    # the trainer's lines (train/trainer.py Trainer.saved), as torchrun's agent passes them to the pod's log
    apiserver.start(pod, log="step 100/200 | loss 3.1\n"
                             "checkpoint at step 100 written in 8.40s (training blocked 0.20s)\n"
                             "checkpoint at step 200 written in 45.05s (training blocked 0.30s)\n")
    code, out, err = doctor(cli, kubeconfig)
    assert code == 0, err
    assert grace_line(out) == (  # 45.05 x 1.5 does not fit in 60 s
        "warn  grace: terminationGracePeriodSeconds 90 s from the default rule: checkpoint.grace_seconds 60 + 30; "
        f"measured write 45.0 s at step 200 of pod {pod}'s log needs 88 s to save: `kubetrain k8s fetch tiny`, and "
        "render follows it")
    apiserver.logs[pod] = "checkpoint at step 300 written in 31.05s (training blocked 0.20s)\n"  # 47 s: 60 holds
    code, out, _ = doctor(cli, kubeconfig)
    assert grace_line(out).startswith("ok    grace: terminationGracePeriodSeconds 90 s from the default rule")
    # a 0.1 s save in a 20 s grace: the rule's own 20 s allowance for the steps is no reason to warn
    apiserver.logs[pod] = "checkpoint at step 400 written in 0.10s (training blocked 0.02s)\n"
    code, out, _ = doctor(cli, kubeconfig, "checkpoint.grace_seconds=20")
    assert grace_line(out) == ("ok    grace: terminationGracePeriodSeconds 50 s from the default rule: "
                               "checkpoint.grace_seconds 20 + 30")
    apiserver.logs[pod] = "checkpoint at step 300 written in 12.00s (training blocked 0.20s)\n"
    code, out, _ = doctor(cli, kubeconfig, "k8s.grace_period_seconds=60")  # explicit, and shorter than 38 + 30
    assert grace_line(out).startswith("warn  grace: terminationGracePeriodSeconds 60 s from k8s.grace_period_seconds; "
                                      "k8s.grace_period_seconds (60) is shorter than the 68 s a save needs")

"""status and list over HTTP, and how a pod's rank and a workload's state are read."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

Cli = Callable[..., tuple[int, str, str]]
PODS = "/api/v1/namespaces/ml/pods"


def launched(tmp_path: Path, apiserver: Any, cli: Cli) -> Path:
    kubeconfig = apiserver.kubeconfig(tmp_path)
    code, _, err = cli(
        "k8s",
        "launch",
        "--set",
        "k8s.namespace=ml",
        "--set",
        "k8s.nnodes=2",
        "--kubeconfig",
        str(kubeconfig),
    )
    assert code == 0, err
    apiserver.answer(
        "GET", "/apis/batch/v1/namespaces/ml/jobs/tiny", 200, apiserver.recorded("job_running")
    )
    apiserver.answer("GET", PODS, 200, apiserver.recorded("pods_tiny"))
    return kubeconfig


def test_status_shows_state_ranks_and_last_step(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    kubeconfig = launched(tmp_path, apiserver, cli)
    apiserver.answer(
        "GET",
        f"{PODS}/tiny-0-4mq9d/log",
        200,
        b"model: 0.04M parameters\nstep 110/200 | loss 3.1\nstep 120/200 | loss 3.0\n",
        "text/plain",
    )
    apiserver.answer("GET", f"{PODS}/tiny-1-x7k2p/log", 200, b"[entrypoint] node 1/2\n", "text/plain")
    code, out, err = cli("k8s", "status", "tiny", "--kubeconfig", str(kubeconfig))
    assert code == 0, err
    assert out.splitlines() == [
        "tiny (indexed-job, namespace ml): running, step 120/200",
        "  rank 0: tiny-0-4mq9d Running on gpu-a, 0 restarts",
        "  rank 1: tiny-1-x7k2p Running on gpu-b, 2 restarts",
    ]
    selector = next(r for r in apiserver.requests if r["path"] == PODS)["query"]["labelSelector"]
    assert selector == ["kubetrain.dev/job=tiny"]
    code, out, _ = cli("k8s", "status", "tiny", "--kubeconfig", str(kubeconfig), "--json")
    status = json.loads(out)
    assert status["state"] == "running" and status["step"] == 120 and status["max_steps"] == 200
    assert [p["rank"] for p in status["pods"]] == [0, 1]


def test_status_of_an_unknown_job(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    code, _, err = cli("k8s", "status", "nope", "--kubeconfig", str(apiserver.kubeconfig(tmp_path)))
    assert code == 2 and "no kubetrain job 'nope' in namespace ml" in err


def test_list_finds_launched_jobs(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    kubeconfig = launched(tmp_path, apiserver, cli)
    code, out, _ = cli("k8s", "list", "--kubeconfig", str(kubeconfig), "--json")
    (job,) = json.loads(out)
    assert (job["name"], job["namespace"], job["workload"], job["state"]) == (
        "tiny",
        "ml",
        "indexed-job",
        "running",
    )
    code, out, _ = cli("k8s", "list", "-A", "--kubeconfig", str(kubeconfig))
    assert code == 0 and out.startswith("ml/tiny  indexed-job  running")


def launch(cli: Cli, kubeconfig: Path, *sets: str) -> None:
    args = [a for item in ("k8s.namespace=ml", *sets) for a in ("--set", item)]
    code, _, err = cli("k8s", "launch", *args, "--kubeconfig", str(kubeconfig))
    assert code == 0, err


def test_one_line_per_rank_from_its_newest_pod(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    kubeconfig = apiserver.kubeconfig(tmp_path)
    launch(cli, kubeconfig, "k8s.nnodes=2")
    first, other = apiserver.pod("tiny", 0), apiserver.pod("tiny", 1)
    apiserver.start(first, "step 10/20 | loss 3.1\n")
    apiserver.start(other, "[entrypoint] node 1/2\n", node="node-b")
    apiserver.exit(first, 1, "RuntimeError: NCCL timeout\n")  # the Job controller replaces it
    replacement = apiserver.pod("tiny", 0)
    assert replacement != first
    apiserver.start(replacement, "resuming from step 14\nstep 14/20 | loss 2.9\n")
    code, out, err = cli("k8s", "status", "tiny", "--kubeconfig", str(kubeconfig))
    assert code == 0, err
    assert out.splitlines() == [
        "tiny (indexed-job, namespace ml): running, step 14/20",
        f"  rank 0: {replacement} Running on node-a, 0 restarts, 1 earlier failed pod",
        f"  rank 1: {other} Running on node-b, 0 restarts",
    ]


def test_pods_that_cannot_be_scheduled_are_pending_with_the_reason(
    tmp_path: Path, apiserver: Any, cli: Cli
) -> None:
    kubeconfig = apiserver.kubeconfig(tmp_path)
    launch(cli, kubeconfig, "k8s.nnodes=2", "k8s.resources.memory=100Gi")
    assert apiserver.objects["/apis/batch/v1/namespaces/ml/jobs/tiny"]["status"]["active"] == 2
    for rank in (0, 1):
        apiserver.unschedulable(apiserver.pod("tiny", rank), "0/1 nodes are available: 1 Insufficient memory.")
    code, out, _ = cli("k8s", "status", "tiny", "--kubeconfig", str(kubeconfig), "--json")
    status = json.loads(out)
    assert status["state"] == "pending: 0/1 nodes are available: 1 Insufficient memory."
    apiserver.schedule(apiserver.pod("tiny", 1))  # the kubelet pulls the image
    code, out, err = cli("k8s", "status", "tiny", "--kubeconfig", str(kubeconfig))
    assert code == 0, err
    assert out.splitlines()[1:] == [
        f"  rank 0: {apiserver.pod('tiny', 0)} Pending on (not scheduled), 0 restarts: 0/1 nodes are available: "
        "1 Insufficient memory.",
        f"  rank 1: {apiserver.pod('tiny', 1)} Pending on node-a, 0 restarts: ContainerCreating",
    ]
    code, out, _ = cli("k8s", "list", "--kubeconfig", str(kubeconfig))
    assert code == 0 and out.startswith("ml/tiny  indexed-job  pending: 0/1 nodes are available")


def test_a_finished_run_says_so(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    kubeconfig = apiserver.kubeconfig(tmp_path)
    launch(cli, kubeconfig, "k8s.nnodes=2", "k8s.workload=statefulset")
    for rank in (0, 1):
        apiserver.start(apiserver.pod("tiny", rank), "step 20/20 | loss 2.0\n[entrypoint] training finished; "
                        "idling so the StatefulSet does not restart it\n")
    code, out, _ = cli("k8s", "status", "tiny", "--kubeconfig", str(kubeconfig))
    assert code == 0 and out.splitlines()[0] == "tiny (statefulset, namespace ml): finished, step 20/20"
    launch(cli, kubeconfig, "k8s.name=job2")
    apiserver.start(apiserver.pod("job2", 0), "step 200/200\n")
    apiserver.exit(apiserver.pod("job2", 0), 0)
    code, out, _ = cli("k8s", "list", "--kubeconfig", str(kubeconfig), "--json")
    assert {j["name"]: j["state"] for j in json.loads(out)} == {"job2": "succeeded", "tiny": "finished"}


def test_shell_execs_kubectl_into_the_ranks_pod(tmp_path: Path, apiserver: Any, cli: Cli,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import subprocess
    import sys

    kubeconfig = str(apiserver.kubeconfig(tmp_path))
    apiserver.answer("GET", PODS, 200, apiserver.recorded("pods_tiny"))
    expected = (f"exec -it -n ml tiny-1-x7k2p -c trainer --kubeconfig={kubeconfig} -- /bin/sh")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    code, _, err = cli("k8s", "shell", "tiny", "--rank", "1", "--kubeconfig", kubeconfig)
    assert code == 2 and "kubectl is not on PATH" in err and expected in err
    # with a kubectl on PATH, the command becomes it (a stand-in that prints its arguments)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "kubectl").write_text('#!/bin/sh\necho "kubectl $*"\n')
    (bin_dir / "kubectl").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.path.dirname(sys.executable)}"}
    done = subprocess.run([sys.executable, "-m", "kubetrain", "k8s", "shell", "tiny", "--rank", "1",
                           "--kubeconfig", kubeconfig], env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"kubectl {expected}"

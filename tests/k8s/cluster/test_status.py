"""status and list over HTTP, and how a pod's rank and a workload's state are read."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kubetrain.k8s.cluster.status import node_rank, workload_state

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


@pytest.mark.parametrize(
    ("labels", "annotations", "name", "rank"),
    [
        (
            {"training.kubeflow.org/replica-type": "master", "training.kubeflow.org/replica-index": "0"},
            {},
            "j-master-0",
            0,
        ),
        (
            {"training.kubeflow.org/replica-type": "worker", "training.kubeflow.org/replica-index": "2"},
            {},
            "j-worker-2",
            3,
        ),
        ({}, {"batch.kubernetes.io/job-completion-index": "5"}, "j-5-abcde", 5),
        ({"apps.kubernetes.io/pod-index": "3"}, {}, "j-3", 3),
        ({}, {}, "j-7", 7),
        ({}, {}, "no-ordinal-here", None),
    ],
)
def test_node_rank_of_each_controllers_pods(
    labels: dict[str, str], annotations: dict[str, str], name: str, rank: int | None
) -> None:
    assert node_rank({"metadata": {"name": name, "labels": labels, "annotations": annotations}}) == rank


def test_workload_states() -> None:
    def obj(kind: str, *conditions: str, **status: Any) -> dict[str, Any]:
        conds = [{"type": c, "status": "True"} for c in conditions]
        return {"kind": kind, "spec": {"replicas": 2}, "status": {"conditions": conds, **status}}

    assert workload_state(obj("Job", "Complete")) == "succeeded"
    assert workload_state(obj("Job", "Failed")) == "failed"
    assert workload_state(obj("Job")) == "pending"
    assert workload_state(obj("PyTorchJob", "Created", "Running")) == "running"
    assert workload_state(obj("JobSet", "Completed")) == "succeeded"
    assert workload_state(obj("StatefulSet", readyReplicas=1)) == "1/2 pods ready"
    assert workload_state(None).startswith("gone")


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

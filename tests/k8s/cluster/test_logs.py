"""logs: every rank's lines, prefixed with the rank, streamed over HTTP; one rank with --rank."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

Cli = Callable[..., tuple[int, str, str]]
PODS = "/api/v1/namespaces/ml/pods"


def test_logs_of_every_rank_and_of_one(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    kubeconfig = str(apiserver.kubeconfig(tmp_path))
    apiserver.answer("GET", PODS, 200, apiserver.recorded("pods_tiny"))
    apiserver.answer(
        "GET", f"{PODS}/tiny-0-4mq9d/log", 200, b"step 4/8 | loss 5.1\nstep 8/8 | loss 4.7\n", "text/plain"
    )
    apiserver.answer("GET", f"{PODS}/tiny-1-x7k2p/log", 200, b"[entrypoint] node 1/2\n", "text/plain")
    code, out, err = cli("k8s", "logs", "tiny", "-f", "--kubeconfig", kubeconfig)
    assert code == 0, err
    assert sorted(out.splitlines()) == [
        "[rank 0] step 4/8 | loss 5.1",
        "[rank 0] step 8/8 | loss 4.7",
        "[rank 1] [entrypoint] node 1/2",
    ]
    lines = out.splitlines()
    assert lines.index("[rank 0] step 4/8 | loss 5.1") < lines.index("[rank 0] step 8/8 | loss 4.7")
    log_requests = [r for r in apiserver.requests if r["path"].endswith("/log")]
    assert {r["query"]["follow"][0] for r in log_requests} == {"true"}
    assert {r["query"]["container"][0] for r in log_requests} == {"trainer"}

    code, out, _ = cli("k8s", "logs", "tiny", "--rank", "1", "--kubeconfig", kubeconfig)
    assert code == 0 and out.splitlines() == ["[rank 1] [entrypoint] node 1/2"]
    code, _, err = cli("k8s", "logs", "tiny", "--rank", "4", "--kubeconfig", kubeconfig)
    assert code == 2 and "no pods with rank 4 of job 'tiny' in namespace ml" in err


def test_a_pod_that_has_not_started_yet(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    apiserver.answer("GET", PODS, 200, apiserver.recorded("pods_tiny"))
    apiserver.answer("GET", f"{PODS}/tiny-0-4mq9d/log", 200, b"ok\n", "text/plain")
    waiting = {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "reason": "BadRequest",
        "code": 400,
        "message": 'container "trainer" in pod "tiny-1-x7k2p" is waiting to start: ContainerCreating',
    }
    apiserver.answer("GET", f"{PODS}/tiny-1-x7k2p/log", 400, waiting)
    code, out, err = cli("k8s", "logs", "tiny", "--kubeconfig", str(apiserver.kubeconfig(tmp_path)))
    assert code == 2 and out.splitlines() == ["[rank 0] ok"]
    assert "logs of pod tiny-1-x7k2p: HTTP 400" in err and "waiting to start" in err

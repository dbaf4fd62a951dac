"""logs: every rank's lines, prefixed with the rank, streamed over HTTP; one rank with --rank."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubetrain.k8s.cluster.api import connect
from kubetrain.k8s.cluster.logs import stream_logs

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


def launch(cli: Cli, kubeconfig: Path, nnodes: int) -> None:
    code, _, err = cli("k8s", "launch", "--set", "k8s.namespace=ml", "--set", f"k8s.nnodes={nnodes}",
                       "--kubeconfig", str(kubeconfig))
    assert code == 0, err


class Follower:
    """`logs -f` in a thread, as a user runs it beside the cluster's changes."""

    def __init__(self, kubeconfig: Path) -> None:
        self.lines: list[str] = []
        self.error: BaseException | None = None
        cluster = connect(kubeconfig)
        self.thread = threading.Thread(target=self._run, args=(cluster,), daemon=True)
        self.thread.start()

    def _run(self, cluster: Any) -> None:
        try:
            stream_logs(cluster, "tiny", "ml", follow=True, emit=self.lines.append, poll=0.01)
        except BaseException as e:  # handed to the test
            self.error = e

    def saw(self, text: str) -> None:
        deadline = time.monotonic() + 60  # a safety net against a hang, not a timing assertion
        while not any(text in line for line in self.lines):
            assert time.monotonic() < deadline and self.thread.is_alive(), (text, self.lines, self.error)
            time.sleep(0.01)

    def end(self) -> list[str]:
        self.thread.join(timeout=60)
        assert not self.thread.is_alive() and self.error is None, (self.lines, self.error)
        return self.lines


def test_follow_right_after_launch_waits_for_each_rank(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    kubeconfig = apiserver.kubeconfig(tmp_path)
    launch(cli, kubeconfig, 2)
    zero, one = apiserver.pod("tiny", 0), apiserver.pod("tiny", 1)
    follower = Follower(kubeconfig)
    follower.saw(f"[rank 0] (pod {zero} waiting: not scheduled yet)")
    apiserver.schedule(zero)
    follower.saw(f"[rank 0] (pod {zero} waiting: ContainerCreating)")
    apiserver.start(zero, "step 1/4\n")
    apiserver.start(one, "[entrypoint] node 1/2\n")
    follower.saw("[rank 0] step 1/4")
    apiserver.exit(one, 0)
    apiserver.exit(zero, 0, "step 4/4\n")
    lines = follower.end()
    assert [line for line in lines if line.startswith("[rank 0] step")] == ["[rank 0] step 1/4",
                                                                             "[rank 0] step 4/4"]
    assert "[rank 1] [entrypoint] node 1/2" in lines  # no rank's lines lost while another waited


def test_follow_goes_on_in_the_pod_that_replaces_a_failed_one(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    kubeconfig = apiserver.kubeconfig(tmp_path)
    launch(cli, kubeconfig, 1)
    first = apiserver.pod("tiny", 0)
    apiserver.start(first, "step 1/10\n")
    follower = Follower(kubeconfig)
    follower.saw("[rank 0] step 1/10")
    apiserver.exit(first, 1, "RuntimeError: lost a peer\n")
    second = apiserver.pod("tiny", 0)
    follower.saw(f"[rank 0] (pod {first} was replaced by {second}; following it)")
    apiserver.start(second, "resuming from step 1\nstep 10/10\n")
    apiserver.exit(second, 0)
    lines = [line for line in follower.end() if "waiting:" not in line]
    assert lines == ["[rank 0] step 1/10", "[rank 0] RuntimeError: lost a peer",
                     f"[rank 0] (pod {first} was replaced by {second}; following it)",
                     "[rank 0] resuming from step 1", "[rank 0] step 10/10"]


def test_a_rank_without_a_log_is_named_with_the_reason(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    kubeconfig = apiserver.kubeconfig(tmp_path)
    launch(cli, kubeconfig, 2)
    apiserver.start(apiserver.pod("tiny", 0), "ok\n")
    one = apiserver.pod("tiny", 1)
    apiserver.unschedulable(one, "0/1 nodes are available: 1 Insufficient memory.")
    code, out, err = cli("k8s", "logs", "tiny", "--kubeconfig", str(kubeconfig))
    assert code == 1 and out.splitlines() == ["[rank 0] ok"]
    assert err == (f"error: rank 1: pod {one} has no log yet: 0/1 nodes are available: 1 Insufficient memory.\n")
    apiserver.schedule(one)
    code, out, err = cli("k8s", "logs", "tiny", "--kubeconfig", str(kubeconfig))
    assert code == 1 and err == f"error: rank 1: pod {one} has no log yet: ContainerCreating\n"

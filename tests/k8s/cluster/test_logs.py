"""logs: every rank's lines, prefixed with the rank, streamed over HTTP; one rank with --rank."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kubetrain.k8s.cluster.connect import connect
from kubetrain.k8s.cluster.logs import stream_logs
from kubetrain.k8s.cluster.outage import GaveUp, Patience

Cli = Callable[..., tuple[int, str, str]]
PODS = "/api/v1/namespaces/ml/pods"


def test_logs_of_every_rank_and_of_one(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    kubeconfig = str(apiserver.kubeconfig(tmp_path))
    apiserver.answer("GET", PODS, 200, apiserver.recorded("pods_tiny"))
    # -f asks for `timestamps`: the kubelet puts the runtime's stamp before every line
    apiserver.answer("GET", f"{PODS}/tiny-0-4mq9d/log", 200, b"2026-11-26T02:30:00.1Z step 4/8 | loss 5.1\n"
                     b"2026-11-26T02:30:01.25Z step 8/8 | loss 4.7\n", "text/plain")
    apiserver.answer("GET", f"{PODS}/tiny-1-x7k2p/log", 200, b"2026-11-26T02:30:00Z [entrypoint] node 1/2\n",
                     "text/plain")
    code, out, err = cli("k8s", "logs", "tiny", "-f", "--kubeconfig", kubeconfig)
    assert code == 0, err
    assert sorted(out.splitlines()) == [
        "[pod 0] step 4/8 | loss 5.1",
        "[pod 0] step 8/8 | loss 4.7",
        "[pod 1] [entrypoint] node 1/2",
    ]
    lines = out.splitlines()
    assert lines.index("[pod 0] step 4/8 | loss 5.1") < lines.index("[pod 0] step 8/8 | loss 4.7")
    log_requests = [r for r in apiserver.requests if r["path"].endswith("/log")]
    assert {r["query"]["follow"][0] for r in log_requests} == {"true"}
    assert {r["query"]["container"][0] for r in log_requests} == {"trainer"}
    apiserver.answer("GET", f"{PODS}/tiny-1-x7k2p/log", 200, b"[entrypoint] node 1/2\n", "text/plain")

    code, out, _ = cli("k8s", "logs", "tiny", "--rank", "1", "--kubeconfig", kubeconfig)
    assert code == 0 and out.splitlines() == ["[pod 1] [entrypoint] node 1/2"]
    code, _, err = cli("k8s", "logs", "tiny", "--rank", "4", "--kubeconfig", kubeconfig)
    assert code == 2 and "no pods with rank 4 of job 'tiny' in namespace ml" in err


def launch(cli: Cli, kubeconfig: Path, nnodes: int) -> None:
    code, _, err = cli("k8s", "launch", "--set", "k8s.namespace=ml", "--set", f"k8s.nnodes={nnodes}",
                       "--kubeconfig", str(kubeconfig))
    assert code == 0, err


# Waits between tries short enough for a test; a request or a silent stream given up on within a second.
QUICK = Patience(give_up_after=60, first_wait=0.01, longest_wait=0.1, idle=1.0)


class Follower:
    """`logs -f` in a thread, as a user runs it beside the cluster's changes."""

    def __init__(self, kubeconfig: Path, patience: Patience = QUICK) -> None:
        self.lines: list[str] = []
        self.error: BaseException | None = None
        cluster = connect(kubeconfig)
        cluster.timeout = 1.0
        self.thread = threading.Thread(target=self._run, args=(cluster, patience), daemon=True)
        self.thread.start()

    def _run(self, cluster: Any, patience: Patience) -> None:
        try:
            stream_logs(cluster, "tiny", "ml", follow=True, emit=self.lines.append, poll=0.01, patience=patience)
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


def following_one_rank(tmp_path: Path, apiserver: Any, cli: Cli, log: str,
                       patience: Patience = QUICK) -> tuple[str, Follower]:
    """A one-pod job whose container started writing `log`, followed until its last line was printed."""
    kubeconfig = apiserver.kubeconfig(tmp_path)
    launch(cli, kubeconfig, 1)
    pod = apiserver.pod("tiny", 0)
    apiserver.start(pod, log)
    follower = Follower(kubeconfig, patience)
    follower.saw(f"[pod 0] {log.splitlines()[-1]}")
    return pod, follower


def test_follow_right_after_launch_waits_for_each_rank(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    kubeconfig = apiserver.kubeconfig(tmp_path)
    launch(cli, kubeconfig, 2)
    zero, one = apiserver.pod("tiny", 0), apiserver.pod("tiny", 1)
    follower = Follower(kubeconfig)
    follower.saw(f"[pod 0] (pod {zero} waiting: not scheduled yet)")
    apiserver.schedule(zero)
    follower.saw(f"[pod 0] (pod {zero} waiting: ContainerCreating)")
    apiserver.start(zero, "step 1/4\n")
    apiserver.start(one, "[entrypoint] node 1/2\n")
    follower.saw("[pod 0] step 1/4")
    apiserver.exit(one, 0)
    apiserver.exit(zero, 0, "step 4/4\n")
    lines = follower.end()
    assert [line for line in lines if line.startswith("[pod 0] step")] == ["[pod 0] step 1/4",
                                                                             "[pod 0] step 4/4"]
    assert "[pod 1] [entrypoint] node 1/2" in lines  # no rank's lines lost while another waited


def test_follow_goes_on_in_the_pod_that_replaces_a_failed_one(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    first, follower = following_one_rank(tmp_path, apiserver, cli, "step 1/10\n")
    apiserver.exit(first, 1, "RuntimeError: lost a peer\n")
    second = apiserver.pod("tiny", 0)
    follower.saw(f"[pod 0] (pod {first} was replaced by {second}; following it)")
    apiserver.start(second, "resuming from step 1\nstep 10/10\n")
    apiserver.exit(second, 0)
    lines = [line for line in follower.end() if "waiting:" not in line]
    assert lines == ["[pod 0] step 1/10", "[pod 0] RuntimeError: lost a peer",
                     f"[pod 0] (pod {first} was replaced by {second}; following it)",
                     "[pod 0] resuming from step 1", "[pod 0] step 10/10"]


def test_a_rank_without_a_log_is_named_with_the_reason(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    kubeconfig = apiserver.kubeconfig(tmp_path)
    launch(cli, kubeconfig, 2)
    apiserver.start(apiserver.pod("tiny", 0), "ok\n")
    one = apiserver.pod("tiny", 1)
    apiserver.unschedulable(one, "0/1 nodes are available: 1 Insufficient memory.")
    code, out, err = cli("k8s", "logs", "tiny", "--kubeconfig", str(kubeconfig))
    assert code == 1 and out.splitlines() == ["[pod 0] ok"]
    assert err == (f"error: rank 1: pod {one} has no log yet: 0/1 nodes are available: 1 Insufficient memory.\n")
    apiserver.schedule(one)
    code, out, err = cli("k8s", "logs", "tiny", "--kubeconfig", str(kubeconfig))
    assert code == 1 and err == f"error: rank 1: pod {one} has no log yet: ContainerCreating\n"


def still_following(apiserver: Any, follower: Follower, polls: int = 20) -> None:
    """Until the readers listed the pods `polls` more times (each does once a poll), or `logs -f` ended: it must
    not, since the job is still active (the deadline is a safety net against a hang)."""
    seen = len(apiserver.requests)
    deadline = time.monotonic() + 60
    while sum(r["path"] == PODS for r in apiserver.requests[seen:]) < polls and follower.thread.is_alive():
        assert time.monotonic() < deadline, "the readers stopped asking for the pods"
        time.sleep(0.01)
    assert follower.thread.is_alive(), ("logs -f ended while the job is active", follower.lines, follower.error)


def _two_ranks_followed(tmp_path: Path, apiserver: Any, cli: Cli) -> tuple[Any, Any, Follower]:
    """A launched 2-pod job whose pods have each written a line, and `logs -f` following it."""
    kubeconfig = apiserver.kubeconfig(tmp_path)
    launch(cli, kubeconfig, 2)
    zero, one = apiserver.pod("tiny", 0), apiserver.pod("tiny", 1)
    apiserver.start(zero, "step 1/8\n")
    apiserver.start(one, "[entrypoint] node 1/2\n")
    follower = Follower(kubeconfig)
    return zero, one, follower


def test_follow_outlives_containers_that_ended_while_their_pods_still_say_running(
        tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    zero, one, follower = _two_ranks_followed(tmp_path, apiserver, cli)
    follower.saw("[pod 0] step 1/8")
    follower.saw("[pod 1] [entrypoint] node 1/2")
    # kill -9 of rank 0's launcher; rank 1 loses its rendezvous host. Both logs end, both pods still say Running.
    apiserver.exit(zero, 137, reported=False)
    apiserver.exit(one, 69, "RendezvousConnectionError: The connection to the C10d store has failed.\n",
                   reported=False)
    follower.saw("[pod 1] RendezvousConnectionError")
    still_following(apiserver, follower)
    apiserver.report(zero)  # the kubelet catches up: Failed; the Job controller makes a pod for each index
    apiserver.report(one)
    new_zero, new_one = apiserver.pod("tiny", 0), apiserver.pod("tiny", 1)
    assert {new_zero, new_one}.isdisjoint({zero, one})
    apiserver.start(new_zero, "resuming from step 1\n")
    apiserver.start(new_one, "[entrypoint] node 1/2\n")
    follower.saw("[pod 0] resuming from step 1")
    apiserver.exit(new_one, 0)
    apiserver.exit(new_zero, 0, "step 8/8\n")
    lines = [line for line in follower.end() if "waiting:" not in line]
    assert [line for line in lines if line.startswith("[pod 0]")] == [
        "[pod 0] step 1/8", f"[pod 0] (pod {zero} was replaced by {new_zero}; following it)",
        "[pod 0] resuming from step 1", "[pod 0] step 8/8"]
    assert [line for line in lines if line.startswith("[pod 1]")] == [
        "[pod 1] [entrypoint] node 1/2",
        "[pod 1] RendezvousConnectionError: The connection to the C10d store has failed.",
        f"[pod 1] (pod {one} was replaced by {new_one}; following it)", "[pod 1] [entrypoint] node 1/2"]


def test_follow_prints_the_replacement_of_a_gracefully_deleted_pod(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    kubeconfig = apiserver.kubeconfig(tmp_path)
    launch(cli, kubeconfig, 2)
    zero, one = apiserver.pod("tiny", 0), apiserver.pod("tiny", 1)
    apiserver.start(zero, "step 1/4\n")
    apiserver.start(one, "[entrypoint] node 1/2\n")
    follower = Follower(kubeconfig)
    follower.saw("[pod 0] step 1/4")
    # kubectl delete pod: rank 0 saves and exits 75, rank 1 loses its peer; the kubelets have not reported yet
    apiserver.delete_pod(zero, log="saved a checkpoint at step 2\n", reported=False)
    apiserver.exit(one, 69, "RendezvousConnectionError: The connection to the C10d store has failed.\n",
                   reported=False)
    follower.saw("[pod 1] RendezvousConnectionError")
    still_following(apiserver, follower)
    apiserver.report(one)  # Failed (exit 69 is ignored by the podFailurePolicy): replaced at once
    apiserver.report(zero)  # terminal, then deleted by the kubelet: replaced at the Job controller's next sync
    follower.saw(f"[pod 0] (pod {zero} is gone while the job is active: it is being replaced)")
    apiserver.sync("tiny")
    new_zero, new_one = apiserver.pod("tiny", 0), apiserver.pod("tiny", 1)
    apiserver.start(new_zero, "resuming from step 2\nstep 4/4\n")
    apiserver.start(new_one, "[entrypoint] node 1/2 again\n")
    follower.saw("[pod 1] [entrypoint] node 1/2 again")
    follower.saw("[pod 0] step 4/4")
    apiserver.exit(new_one, 0)
    apiserver.exit(new_zero, 0)
    lines = [line for line in follower.end() if "waiting:" not in line and "no pod yet" not in line]
    assert [line for line in lines if line.startswith("[pod 0]")] == [
        "[pod 0] step 1/4", "[pod 0] saved a checkpoint at step 2",
        f"[pod 0] (pod {zero} is gone while the job is active: it is being replaced)",
        "[pod 0] resuming from step 2", "[pod 0] step 4/4"]
    assert f"[pod 1] (pod {one} was replaced by {new_one}; following it)" in lines


@pytest.mark.parametrize("how", ["end", "reset"])
def test_follow_opens_a_stream_that_broke_off_again_and_prints_each_line_once(
        tmp_path: Path, apiserver: Any, cli: Cli, how: str) -> None:
    """A stream can end while its container runs on (an API server restart, a proxy's timeout, a reset): `logs -f`
    went quiet for good. Now it opens the stream again from the second of its last line and skips what it printed."""
    pod, follower = following_one_rank(tmp_path, apiserver, cli, "step 1/9\nstep 2/9\n")
    opened = sum(r["path"].endswith("/log") for r in apiserver.requests)
    apiserver.break_stream(pod, how, "step 3/9\n")  # written as the stream broke: it never got it
    follower.saw("[pod 0] step 3/9")
    apiserver.write_log(pod, "step 4/9\n")
    follower.saw("[pod 0] step 4/9")
    apiserver.exit(pod, 0, "step 9/9\n")
    lines = [line for line in follower.end() if "waiting:" not in line]
    broke = [f"[pod 0] (the log stream of pod {pod} broke off: " in line for line in lines]
    assert [line for line, b in zip(lines, broke, strict=True) if not b] == [
        "[pod 0] step 1/9", "[pod 0] step 2/9", "[pod 0] step 3/9", "[pod 0] step 4/9", "[pod 0] step 9/9"]
    assert broke.count(True) == (how == "reset") and (how == "end" or broke.index(True) == 2)
    [again, *_] = [r for r in apiserver.requests if r["path"].endswith("/log")][opened:]
    assert again["query"]["timestamps"] == ["true"]
    assert len(again["query"]["sinceTime"][0]) == len("2026-11-26T02:30:00Z")  # whole seconds, as metav1.Time


def test_follow_of_a_failed_job_exits_1_with_one_line(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    kubeconfig = apiserver.kubeconfig(tmp_path)
    code, _, err = cli("k8s", "launch", "--set", "k8s.namespace=ml", "--set", "k8s.backoff_limit=0",
                       "--kubeconfig", str(kubeconfig))
    assert code == 0, err
    pod = apiserver.pod("tiny", 0)
    apiserver.start(pod, "step 1/8\n")
    apiserver.exit(pod, 1, "RuntimeError: CUDA error: an illegal memory access was encountered\n")
    code, out, err = cli("k8s", "logs", "tiny", "-f", "--kubeconfig", str(kubeconfig))
    assert code == 1 and out.splitlines() == [
        "[pod 0] step 1/8", "[pod 0] RuntimeError: CUDA error: an illegal memory access was encountered"]
    assert err == ("error: job 'tiny' failed: BackoffLimitExceeded: Job has reached the specified backoff limit; "
                   f"rank 0: container trainer of pod {pod} exited 1\n")
    code, out, err = cli("k8s", "logs", "tiny", "--kubeconfig", str(kubeconfig))  # without -f: what is there
    assert code == 0, err


def rank_lines(lines: list[str]) -> list[str]:
    """What the ranks wrote, without our own parenthesised status lines."""
    return [line for line in lines if not line.startswith("(") and "] (" not in line]


def test_follow_rides_out_an_api_server_restart(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    """kube-apiserver restarts: it first answers 429 (shutting down, Retry-After 5: the client's urllib3 waits and
    asks again), then its port refuses connections and its streams drop, then it serves again. `logs -f` exited 2
    at the first refused request while the job trained on; now it says so once, waits, prints what the container
    wrote meanwhile, once, and ends with the job."""
    pod, follower = following_one_rank(tmp_path, apiserver, cli, "step 1/9\n")
    apiserver.refuse(1)
    apiserver.break_stream(pod, "end", "step 2/9\n")  # the stream closes; asking again meets the 429
    follower.saw("[pod 0] step 2/9")
    assert apiserver.refused == 1
    apiserver.down()
    follower.saw("(API server unreachable, retrying for up to 1 min: connection refused)")
    apiserver.write_log(pod, "step 3/9\n")
    time.sleep(0.5)  # several tries meet the closed port
    assert follower.thread.is_alive()
    apiserver.up()
    follower.saw("[pod 0] step 3/9")
    apiserver.exit(pod, 0, "step 9/9\n")
    lines = follower.end()
    assert [line for line in lines if "waiting:" not in line] == [
        "[pod 0] step 1/9", "[pod 0] step 2/9",
        f"[pod 0] (the log stream of pod {pod} broke off: Response ended prematurely; opening it again)",
        "(API server unreachable, retrying for up to 1 min: connection refused)",  # said once
        "[pod 0] step 3/9", "[pod 0] step 9/9"]


def test_follow_rides_out_requests_that_time_out(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    """Requests the API server takes and never answers (its storage stalled) end at the client's timeout (1 s here);
    urllib3 asks three more times, and then the follow retries instead of exiting 2 ("timed out")."""
    pod, follower = following_one_rank(tmp_path, apiserver, cli, "step 1/4\n")
    apiserver.time_out(5)
    apiserver.break_stream(pod, "end", "step 2/4\n")
    follower.saw("(API server unreachable, retrying for up to 1 min: timed out)")
    follower.saw("[pod 0] step 2/4")
    apiserver.exit(pod, 0, "step 4/4\n")
    assert rank_lines(follower.end()) == ["[pod 0] step 1/4", "[pod 0] step 2/4", "[pod 0] step 4/4"]


def test_follow_gives_up_after_the_stated_time_with_one_line(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    patience = Patience(give_up_after=0.5, first_wait=0.01, longest_wait=0.1, idle=1.0)
    pod, follower = following_one_rank(tmp_path, apiserver, cli, "step 1/9\n", patience)
    apiserver.down()
    follower.thread.join(timeout=30)
    assert isinstance(follower.error, GaveUp) and follower.error.exit_code == 1, (follower.lines, follower.error)
    assert str(follower.error).startswith(f"gave up following the logs: the API server at {apiserver.url} ")
    assert "answered nothing for" in str(follower.error) and "connection refused" in str(follower.error)
    assert follower.lines[1:] == [
        f"[pod 0] (the log stream of pod {pod} broke off: Response ended prematurely; opening it again)",
        "(API server unreachable, retrying for up to 0s: connection refused)"]


def test_a_kubelet_error_in_the_stream_is_our_line_not_the_ranks(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    """The kubelet writes a failed ReadLogs' error into the answer it began (rpc error: ... DeadlineExceeded on a
    stalled node): it was printed as a line of rank 0's log. It is one of our status lines; the stream is opened
    again and the container's lines follow, once."""
    pod, follower = following_one_rank(tmp_path, apiserver, cli, "step 1/4\n")
    apiserver.break_stream(pod, "kubelet-error", "step 2/4\n")
    follower.saw("[pod 0] step 2/4")
    apiserver.exit(pod, 0, "step 4/4\n")
    lines = follower.end()
    assert rank_lines(lines) == ["[pod 0] step 1/4", "[pod 0] step 2/4", "[pod 0] step 4/4"]
    assert f"[pod 0] (the log stream of pod {pod} ended with the kubelet's error: rpc error: code = " \
           "DeadlineExceeded desc = context deadline exceeded; opening it again)" in lines
    assert not any(line.startswith("[pod 0] rpc error") for line in lines)


def test_follow_leaves_a_stalled_stream_for_the_pod_that_replaced_it(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    """A node under memory pressure: its kubelet keeps the stream open and sends nothing, the pod is replaced. The
    follow never printed a line of the new pod; now a stream silent for `idle` is looked at again."""
    zero, one, follower = _two_ranks_followed(tmp_path, apiserver, cli)
    follower.saw("[pod 1] [entrypoint] node 1/2")
    apiserver.break_stream(one, "stall", "[rank 1 stalls]\n")
    apiserver.exit(one, 137)  # its node's kernel ended it; the Job controller replaces the pod
    new_one = apiserver.pod("tiny", 1)
    apiserver.start(new_one, "[entrypoint] node 1/2 again\n")
    follower.saw("[pod 1] [entrypoint] node 1/2 again")
    apiserver.exit(new_one, 0)
    apiserver.exit(zero, 0, "step 8/8\n")
    lines = follower.end()
    assert [line for line in rank_lines(lines) if line.startswith("[pod 1]")] == [
        "[pod 1] [entrypoint] node 1/2", "[pod 1] [rank 1 stalls]", "[pod 1] [entrypoint] node 1/2 again"]
    assert f"[pod 1] (pod {one} was replaced by {new_one}; following it)" in lines


def test_follow_prints_each_pod_once_and_never_goes_back_to_a_pod_it_left(
        tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    """Rank 0's pod stops after a checkpoint (exit 75: the Job keeps it, and replaces it), then its
    replacement is deleted. Until the controller makes the next pod, the kept pod was the rank's newest again:
    `logs -f` said it replaced the deleted one and printed its lines a second time."""
    first, follower = following_one_rank(tmp_path, apiserver, cli, "step 1/8\n")
    apiserver.exit(first, 75, "stopped at step 2 after its checkpoint\n")
    second = apiserver.pod("tiny", 0)
    assert second != first
    apiserver.start(second, "resuming from step 2\nstep 3/8\n")
    follower.saw("[pod 0] step 3/8")
    apiserver.delete_pod(second, log="stopped at step 4 after its checkpoint\n")  # gone; replaced at the next sync
    follower.saw(f"[pod 0] (pod {second} is gone while the job is active: it is being replaced)")
    still_following(apiserver, follower)
    apiserver.sync("tiny")
    third = apiserver.pod("tiny", 0)
    assert third not in (first, second)
    apiserver.start(third, "resuming from step 4\nstep 8/8\n")
    apiserver.exit(third, 0)
    lines = [line for line in follower.end() if "waiting:" not in line and "no pod yet" not in line]
    said = rank_lines(lines)
    assert len(said) == len(set(said)), lines  # no line printed twice
    assert not any(f"replaced by {first}" in line for line in lines), lines
    assert said == ["[pod 0] step 1/8", "[pod 0] stopped at step 2 after its checkpoint",
                    "[pod 0] resuming from step 2", "[pod 0] step 3/8",
                    "[pod 0] stopped at step 4 after its checkpoint", "[pod 0] resuming from step 4",
                    "[pod 0] step 8/8"]


def test_a_pod_whose_worker_has_another_global_rank_says_both_once(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    """After a rendezvous gave the ranks out again, pod 1 runs global rank 0: `[rank 1] [rank 0] step` read as two
    ranks. A worker's line names its pod and its rank once each; the launcher's lines name their pod, never a rank
    (it has none: `[rank 1] incident: hang on rank 0` read as rank 1 saying it)."""
    kubeconfig = apiserver.kubeconfig(tmp_path)
    launch(cli, kubeconfig, 2)
    zero, one = apiserver.pod("tiny", 0), apiserver.pod("tiny", 1)
    apiserver.start(zero, "[entrypoint] node 0/2\n[rank 1] SIGTERM: finishing this step\n")
    apiserver.start(one, "[entrypoint] node 1/2\n[rank 0] step 3/8 | loss 4.2\nincident: hang on rank 0\n")
    code, out, err = cli("k8s", "logs", "tiny", "--kubeconfig", str(kubeconfig))
    assert code == 0, err
    assert sorted(out.splitlines()) == ["[pod 0 · rank 1] SIGTERM: finishing this step",
                                        "[pod 0] [entrypoint] node 0/2",
                                        "[pod 1 · rank 0] step 3/8 | loss 4.2",
                                        "[pod 1] [entrypoint] node 1/2", "[pod 1] incident: hang on rank 0"]
    apiserver.write_log(one, "[rank 1] step 4/8\n")
    code, out, _ = cli("k8s", "logs", "tiny", "--rank", "1", "--kubeconfig", str(kubeconfig))
    assert out.splitlines()[-1] == "[pod 1 · rank 1] step 4/8"  # where they agree too: a worker's line says both


def test_a_reader_that_fails_on_an_unexpected_error_is_reported_not_dropped(
        tmp_path: Path, apiserver: Any, cli: Cli, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank's reader that caught only KubetrainError would let any other exception end its thread, and `logs`
    would print the other ranks and exit 0 as if the rank had nothing to say. Injected: rank 1's pod check raises."""
    from kubetrain.k8s.cluster import logs

    kubeconfig = apiserver.kubeconfig(tmp_path)
    launch(cli, kubeconfig, 2)
    zero, one = apiserver.pod("tiny", 0), apiserver.pod("tiny", 1)
    apiserver.start(zero, "step 1/8\n")
    apiserver.start(one, "[entrypoint] node 1/2\n")
    not_started = logs._not_started

    def broken(pod: dict[str, Any]) -> str | None:
        if pod["metadata"]["name"] == one:
            raise ValueError("an answer the reader could not read")
        return not_started(pod)

    monkeypatch.setattr(logs, "_not_started", broken)
    printed: list[str] = []
    with pytest.raises(logs.ReaderFailed, match="rank 1: reading its log failed: ValueError: an answer"):
        stream_logs(connect(kubeconfig), "tiny", "ml", emit=printed.append)
    assert printed == ["[pod 0] step 1/8"]

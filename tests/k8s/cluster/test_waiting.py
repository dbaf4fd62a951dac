"""A job that waits for something outside it says why, through the CLI: no pods yet (a slow controller, a
suspended Job, an exceeded ResourceQuota), a rank that appears later, a pod being replaced, a Kueue queue."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

Cli = Callable[..., tuple[int, str, str]]
NS = "ml"
JOB = f"/apis/batch/v1/namespaces/{NS}/jobs/tiny"
EVENTS = f"/api/v1/namespaces/{NS}/events"


def launch(cli: Cli, kubeconfig: Path, nnodes: int, *sets: str) -> None:
    args = ["--set", f"k8s.namespace={NS}", "--set", f"k8s.nnodes={nnodes}"]
    for item in sets:
        args += ["--set", item]
    code, _, err = cli("k8s", "launch", *args, "--kubeconfig", str(kubeconfig))
    assert code == 0, err


def quota(apiserver: Any, pods: int) -> None:
    """A namespace's ResourceQuota on pods, as an administrator sets (and raises) it."""
    apiserver.put({"apiVersion": "v1", "kind": "ResourceQuota",
                   "metadata": {"name": "pods", "namespace": NS}, "spec": {"hard": {"pods": str(pods)}}})


def asked(apiserver: Any, path: str, times: int = 1) -> None:
    """Until the command asked for `path` `times` more times: each rank's reader asks once a poll, so one ask per
    rank means every rank saw the cluster as it is now (the deadline is a safety net against a hang)."""
    seen = len(apiserver.requests)
    deadline = time.monotonic() + 60
    while sum(r["path"] == path for r in apiserver.requests[seen:]) < times:
        assert time.monotonic() < deadline, f"the command never asked for {path}"
        time.sleep(0.01)


@contextmanager
def beside(script: Callable[[], None]) -> Iterator[None]:
    """Run `script` (the cluster's changes) in a thread while the test's thread runs a CLI command."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            script()
        except BaseException as e:  # handed to the test
            failure.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    yield
    thread.join(timeout=60)
    assert not thread.is_alive() and not failure, failure


def run_to_completion(apiserver: Any, ranks: int) -> None:
    for rank in range(ranks):
        pod = apiserver.pod("tiny", rank)
        apiserver.start(pod, f"step 1/2 on {rank}\n")
        apiserver.exit(pod, 0, f"step 2/2 on {rank}\n")


def test_follow_before_the_controller_made_pods_waits_saying_why(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    kubeconfig = apiserver.kubeconfig(tmp_path)
    apiserver.job_controller = False  # a slow Job controller: the Job exists, its pods do not yet
    launch(cli, kubeconfig, 2)
    assert apiserver.pods("tiny") == []
    code, out, err = cli("k8s", "status", "tiny", "--kubeconfig", str(kubeconfig))
    assert code == 0 and out.splitlines() == [
        "tiny (indexed-job, namespace ml): pending: no pods yet: not created yet by the Job controller, step unknown",
        "  pod 0: not there: not created yet by the Job controller",
        "  pod 1: not there: not created yet by the Job controller"], out + err
    code, out, err = cli("k8s", "logs", "tiny", "--kubeconfig", str(kubeconfig))
    assert code == 1 and "rank 1: no pod: not created yet by the Job controller" in err

    def cluster() -> None:
        asked(apiserver, EVENTS, times=2)  # both ranks looked for the reason
        apiserver.objects[JOB]["spec"]["suspend"] = True  # kubectl patch job tiny -p '{"spec":{"suspend":true}}'
        apiserver.job_controller = True
        apiserver.sync("tiny")
        asked(apiserver, JOB, times=4)
        apiserver.objects[JOB]["spec"]["suspend"] = False
        apiserver.sync("tiny")
        run_to_completion(apiserver, 2)

    with beside(cluster):
        code, out, err = cli("k8s", "logs", "tiny", "-f", "--kubeconfig", str(kubeconfig))
    assert code == 0, err
    lines = out.splitlines()
    for rank in (0, 1):
        said = [line for line in lines if line.startswith(f"[pod {rank}]")]
        assert said[0] == f"[pod {rank}] (no pod yet: not created yet by the Job controller)"
        assert f"[pod {rank}] (no pod yet: the job is suspended (spec.suspend))" in said
        assert said[-2:] == [f"[pod {rank}] step 1/2 on {rank}", f"[pod {rank}] step 2/2 on {rank}"]


def test_follow_while_a_quota_refuses_the_pods_names_the_event(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    kubeconfig = apiserver.kubeconfig(tmp_path)
    quota(apiserver, 0)
    launch(cli, kubeconfig, 2)
    assert apiserver.pods("tiny") == []

    def cluster() -> None:
        asked(apiserver, EVENTS, times=2)
        quota(apiserver, 2)  # the administrator raises it; the controller tries again after its backoff
        apiserver.sync("tiny")
        run_to_completion(apiserver, 2)

    with beside(cluster):
        code, out, err = cli("k8s", "logs", "tiny", "-f", "--kubeconfig", str(kubeconfig))
    assert code == 0, err
    refused = ('(no pod yet: FailedCreate: Error creating: pods "tiny-{rank}-" is forbidden: exceeded quota: pods, '
               'requested: pods=1, used: pods=0, limited: pods=0)')
    for rank in (0, 1):
        assert f"[pod {rank}] " + refused.format(rank=rank) in out.splitlines()
        assert f"[pod {rank}] step 2/2 on {rank}" in out.splitlines()
    code, out, err = cli("k8s", "logs", "tiny", "--kubeconfig", str(kubeconfig))
    assert code == 0 and "[pod 1] step 2/2 on 1" in out.splitlines()



def test_a_rank_the_quota_holds_back_is_named_then_followed(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    kubeconfig = apiserver.kubeconfig(tmp_path)
    quota(apiserver, 1)
    launch(cli, kubeconfig, 2)
    zero = apiserver.pod("tiny", 0)
    apiserver.start(zero, "[entrypoint] node 0/2\n")
    refused = ('FailedCreate: Error creating: pods "tiny-1-" is forbidden: exceeded quota: pods, requested: pods=1, '
               'used: pods=1, limited: pods=1')
    code, out, err = cli("k8s", "status", "tiny", "--kubeconfig", str(kubeconfig))
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith(f"tiny (indexed-job, namespace ml): pending: rank 1 has no pod: {refused}")
    assert lines[1].startswith(f"  pod 0: {zero} Running")
    assert lines[2].startswith(f"  pod 1: not there: {refused}")

    def cluster() -> None:
        asked(apiserver, EVENTS)  # rank 1's reader looked for why it has no pod
        quota(apiserver, 2)
        apiserver.sync("tiny")
        one = apiserver.pod("tiny", 1)
        apiserver.start(one, "[entrypoint] node 1/2\n")
        apiserver.exit(one, 0)
        apiserver.exit(zero, 0, "step 2/2\n")

    with beside(cluster):
        code, out, err = cli("k8s", "logs", "tiny", "-f", "--kubeconfig", str(kubeconfig))
    assert code == 0, err
    one_said = [line for line in out.splitlines() if line.startswith("[pod 1]")]
    assert one_said[0].startswith(f"[pod 1] (no pod yet: {refused}")  # "(N times)" as the controller retries
    assert one_said[-1] == "[pod 1] [entrypoint] node 1/2" and "[pod 0] step 2/2" in out.splitlines()
    code, out, err = cli("k8s", "status", "tiny", "--kubeconfig", str(kubeconfig))
    assert out.splitlines()[0] == "tiny (indexed-job, namespace ml): succeeded, step 2/2 (100%), training finished"


def test_losing_the_rendezvous_host_follows_both_replacements(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    kubeconfig = apiserver.kubeconfig(tmp_path)
    launch(cli, kubeconfig, 2)
    zero, one = apiserver.pod("tiny", 0), apiserver.pod("tiny", 1)
    apiserver.start(zero, "step 1/4\n")
    apiserver.start(one, "[entrypoint] node 1/2\n")

    def cluster() -> None:
        asked(apiserver, f"/api/v1/namespaces/{NS}/pods/{zero}/log")
        apiserver.delete_pod(zero, log="saved a checkpoint at step 2\n")  # kubectl delete pod: SIGTERM, exit 75
        asked(apiserver, EVENTS)  # rank 0 has no pod now: neither the old one nor its replacement exists
        apiserver.exit(one, 69, "RendezvousConnectionError: The connection to the C10d store has failed.\n")
        new_zero, new_one = apiserver.pod("tiny", 0), apiserver.pod("tiny", 1)
        apiserver.start(new_zero, "resuming from step 2\nstep 4/4\n")
        apiserver.start(new_one, "[entrypoint] node 1/2\n")
        apiserver.exit(new_one, 0)
        apiserver.exit(new_zero, 0)

    with beside(cluster):
        code, out, err = cli("k8s", "logs", "tiny", "-f", "--kubeconfig", str(kubeconfig))
    assert code == 0, err
    new_one = apiserver.pod("tiny", 1)
    zero_said = [line for line in out.splitlines() if line.startswith("[pod 0]") and "waiting:" not in line]
    assert zero_said == ["[pod 0] step 1/4", "[pod 0] saved a checkpoint at step 2",
                         f"[pod 0] (pod {zero} is gone while the job is active: it is being replaced)",
                         "[pod 0] (no pod yet: not created yet by the Job controller)",
                         "[pod 0] resuming from step 2", "[pod 0] step 4/4"]
    one_said = [line for line in out.splitlines() if line.startswith("[pod 1]") and "waiting:" not in line]
    assert one_said == ["[pod 1] [entrypoint] node 1/2",
                        "[pod 1] RendezvousConnectionError: The connection to the C10d store has failed.",
                        f"[pod 1] (pod {one} was replaced by {new_one}; following it)",
                        "[pod 1] [entrypoint] node 1/2"]
    job = apiserver.objects[JOB]
    assert job["status"]["failed"] == 0  # the rendered podFailurePolicy ignored exit 69


WORKLOADS = f"/apis/kueue.x-k8s.io/v1beta1/namespaces/{NS}/workloads"
NO_QUOTA = ("couldn't assign flavors to pod set main: insufficient quota for cpu in flavor default-flavor, "
            "request > maximum capacity (24 > 10)")


def test_a_job_kueue_holds_is_queued_with_the_workloads_reason(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    kubeconfig = apiserver.kubeconfig(tmp_path)
    apiserver.install_kueue()
    launch(cli, kubeconfig, 2, "k8s.queue=team-a")
    assert apiserver.objects[JOB]["spec"]["suspend"] is True and apiserver.pods("tiny") == []
    queued = "queued by Kueue in LocalQueue team-a"
    code, out, err = cli("k8s", "status", "tiny", "--kubeconfig", str(kubeconfig))
    assert code == 0, err
    assert out.splitlines()[0] == f"tiny (indexed-job, namespace ml): {queued}: not considered by Kueue yet, " \
                                  "step unknown"
    apiserver.kueue_pending("tiny", NO_QUOTA)
    code, out, err = cli("k8s", "status", "tiny", "--kubeconfig", str(kubeconfig))
    assert out.splitlines() == [f"tiny (indexed-job, namespace ml): {queued}: no quota reserved: {NO_QUOTA}, "
                                "step unknown",
                                f"  pod 0: not there: {queued}: no quota reserved: {NO_QUOTA}",
                                f"  pod 1: not there: {queued}: no quota reserved: {NO_QUOTA}"]
    code, out, err = cli("k8s", "list", "--kubeconfig", str(kubeconfig))
    assert code == 0 and f"ml/tiny  indexed-job  {queued}: no quota reserved: {NO_QUOTA}  " in out, out + err
    workload = next(r for r in apiserver.requests if r["path"] == WORKLOADS)
    assert workload["query"]["labelSelector"] == [f"kueue.x-k8s.io/job-uid={apiserver.objects[JOB]['metadata']['uid']}"]

    def cluster() -> None:
        asked(apiserver, WORKLOADS, times=2)  # both ranks looked for why
        apiserver.kueue_admit("tiny")
        run_to_completion(apiserver, 2)

    with beside(cluster):
        code, out, err = cli("k8s", "logs", "tiny", "-f", "--kubeconfig", str(kubeconfig))
    assert code == 0, err
    for rank in (0, 1):
        said = [line for line in out.splitlines() if line.startswith(f"[pod {rank}]")]
        assert said[0] == f"[pod {rank}] (no pod yet: {queued}: no quota reserved: {NO_QUOTA})"
        assert said[-1] == f"[pod {rank}] step 2/2 on {rank}"


def test_without_kueue_installed_no_workload_is_asked_for(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    kubeconfig = apiserver.kubeconfig(tmp_path)
    launch(cli, kubeconfig, 1, "k8s.queue=team-a")  # the label is there; nothing acts on it
    code, out, err = cli("k8s", "status", "tiny", "--kubeconfig", str(kubeconfig))
    assert code == 0 and "queued" not in out and "pending: not scheduled yet" in out.splitlines()[0], out + err
    apiserver.objects[JOB]["spec"]["suspend"] = True
    apiserver.sync("tiny")
    code, out, err = cli("k8s", "status", "tiny", "--kubeconfig", str(kubeconfig))
    assert code == 0 and out.splitlines()[0] == "tiny (indexed-job, namespace ml): suspended, step unknown", out
    assert not [r for r in apiserver.requests if r["path"].startswith(WORKLOADS)]


def test_an_event_is_about_the_rank_its_pod_name_says_and_stale_once_a_newer_pod_was_made() -> None:
    from kubetrain.k8s.cluster.waiting import rank_event

    def refused(rank: int, at: str) -> dict[str, Any]:
        return {"reason": "FailedCreate", "lastTimestamp": at,
                "message": f'Error creating: pods "tiny-{rank}-" is forbidden: exceeded quota: pods'}

    events = [refused(1, "2026-03-02T10:05:00Z"), refused(0, "2026-03-02T10:00:00Z")]  # newest first
    assert rank_event(events, "tiny", 1) is events[0] and rank_event(events, "tiny", 0) is events[1]
    assert rank_event(events[:1], "tiny", 0) is None  # rank 1's refusal says nothing about rank 0
    assert rank_event(events, "tiny", 0, since="2026-03-02T10:01:00Z") is None  # rank 0 got a pod after it
    other = {"reason": "FailedCreate", "lastTimestamp": "2026-03-02T10:06:00Z", "message": "Error creating: quota"}
    assert rank_event([other], "tiny", 0) is other  # names no rank: about the whole job

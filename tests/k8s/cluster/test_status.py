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
        "tiny (indexed-job, namespace ml): running, step 120/200 (60%)",
        "  pod 0: tiny-0-4mq9d Running on gpu-a, 0 restarts",
        "  pod 1: tiny-1-x7k2p Running on gpu-b, 2 restarts",
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
        "tiny (indexed-job, namespace ml): running, step 14/20 (70%)",
        f"  last failure: rank 0: container trainer of pod {first} exited 1",  # what ended the earlier pod
        f"  pod 0: {replacement} Running on node-a, 0 restarts, 1 earlier failed pod",
        f"  pod 1: {other} Running on node-b, 0 restarts",
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
        f"  pod 0: {apiserver.pod('tiny', 0)} Pending on (not scheduled), 0 restarts: 0/1 nodes are available: "
        "1 Insufficient memory.",
        f"  pod 1: {apiserver.pod('tiny', 1)} Pending on node-a, 0 restarts: ContainerCreating",
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
    assert code == 0 and out.splitlines()[0] == ("tiny (statefulset, namespace ml): finished, step 20/20 (100%), "
                                          "training finished")
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


def _progress(step: int, eta: float, total: int = 200, slowest: int | None = 1) -> str:
    """Rank 0's console line, as the trainer prints it."""
    from kubetrain.track.console import format_record

    return format_record({"kind": "train", "step": step, "loss": 2.5, "lr": 1e-3, "tokens_per_second": 12345.0,
                          "memory_gib": 1.0, "slowest_rank": slowest, "straggler_ratio": 1.83,
                          "eta_seconds": eta}, total) + "\n"


def test_progress_percent_tokens_eta_and_slowest_rank_from_the_newest_console_line(
    tmp_path: Path, apiserver: Any, cli: Cli
) -> None:
    kubeconfig = apiserver.kubeconfig(tmp_path)
    launch(cli, kubeconfig, "k8s.nnodes=2")
    apiserver.start(apiserver.pod("tiny", 0), "[entrypoint] node 0/2\n")
    # global rank 0 may run in node rank 1's pod: c10d numbers ranks by the order nodes join
    apiserver.start(apiserver.pod("tiny", 1), _progress(110, 900) + "eval step 110: val_loss 2.0 ppl 7.39\n"
                    + _progress(120, 800) + "saved checkpoint step-000120\n", node="node-b")
    code, out, err = cli("k8s", "status", "tiny", "--kubeconfig", str(kubeconfig))
    assert code == 0, err
    assert out.splitlines()[:2] == [
        "tiny (indexed-job, namespace ml): running, step 120/200 (60%), 12,345 tok/s, eta 13:20",
        "  slowest rank: 1 (1.8x the median rank)",
    ]
    code, out, _ = cli("k8s", "status", "tiny", "--kubeconfig", str(kubeconfig), "--json")
    status = json.loads(out)
    assert {k: status[k] for k in ("step", "max_steps", "percent", "tokens_per_second", "eta_seconds",
                                   "training_finished", "slowest_rank", "straggler_ratio", "last_incident")} == {
        "step": 120, "max_steps": 200, "percent": 60.0, "tokens_per_second": 12345.0, "eta_seconds": 800,
        "training_finished": False, "slowest_rank": 1, "straggler_ratio": 1.8, "last_incident": None}
    logs = [r for r in apiserver.requests if r["path"].endswith("/log")]
    assert logs and all(r["query"]["tailLines"] == ["1000"] and "previous" not in r["query"] for r in logs)
    code, out, _ = cli("k8s", "list", "--kubeconfig", str(kubeconfig))  # list reads no logs: state only
    assert code == 0 and out.startswith("ml/tiny  indexed-job  running")


def test_a_job_whose_ranks_stopped_moving_says_for_how_long_and_has_no_eta(
    tmp_path: Path, apiserver: Any, cli: Cli
) -> None:
    """Seen on a real cluster: rank 0 stopped, and status still gave the last step's rate and ETA at +292 s."""
    import time

    kubeconfig = apiserver.kubeconfig(tmp_path)
    launch(cli, kubeconfig)
    pod = apiserver.pod("tiny", 0)
    # 80 steps left in 800 s: a line every 100 s at 10 steps a line; nothing new for 292 s is within 3 such gaps
    apiserver.start(pod, _progress(120, 800, slowest=None))
    apiserver.log_stamps[pod][-1] = time.time_ns() - 292 * 10**9
    status = json.loads(cli("k8s", "status", "tiny", "--kubeconfig", str(kubeconfig), "--json")[1])
    assert (status["stalled"], status["eta_seconds"]) == (False, 800) and 290 <= status["seconds_since_step"] <= 320
    apiserver.log_stamps[pod][-1] = time.time_ns() - 600 * 10**9  # ten minutes: twice the pace's three gaps
    code, out, err = cli("k8s", "status", "tiny", "--kubeconfig", str(kubeconfig))
    assert code == 0, err
    first = out.splitlines()[0]
    assert first.startswith("tiny (indexed-job, namespace ml): running, step 120/200 (60%), 12,345 tok/s, "
                            "no new step for 10:0"), first
    assert "eta" not in first
    status = json.loads(cli("k8s", "status", "tiny", "--kubeconfig", str(kubeconfig), "--json")[1])
    assert status["stalled"] is True and status["eta_seconds"] is None and status["seconds_since_step"] >= 600


def test_a_finished_job_says_so_instead_of_an_eta(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    kubeconfig = apiserver.kubeconfig(tmp_path)
    launch(cli, kubeconfig)
    pod = apiserver.pod("tiny", 0)
    apiserver.start(pod, _progress(199, 2, slowest=None))
    code, out, err = cli("k8s", "status", "tiny", "--kubeconfig", str(kubeconfig))
    assert code == 0, err
    assert out.splitlines()[0] == ("tiny (indexed-job, namespace ml): running, step 199/200 (99.5%), 12,345 tok/s, "
                                   "eta 0:02")
    apiserver.exit(pod, 0, _progress(200, 0, slowest=None) + "exported runs/tiny/hf\n")
    _, out, _ = cli("k8s", "status", "tiny", "--kubeconfig", str(kubeconfig))
    assert out.splitlines()[0] == ("tiny (indexed-job, namespace ml): succeeded, step 200/200 (100%), 12,345 tok/s, "
                                   "training finished")
    status = json.loads(cli("k8s", "status", "tiny", "--kubeconfig", str(kubeconfig), "--json")[1])
    assert status["training_finished"] and status["eta_seconds"] is None and status["slowest_rank"] is None


def _incident(kind: str, rank: int | None, step: int, at: float, message: str) -> str:
    """The launcher's line for an incident, as launch/watch.py prints it."""
    from kubetrain.runs.incidents import log_line

    return log_line({"kind": kind, "rank": rank, "step": step, "time": at, "message": message}) + "\n"


T0 = 1795000000.0  # 2026-11-18T11:06:40Z


def test_the_last_incident_is_the_newest_line_of_any_pod_or_its_previous_container(
    tmp_path: Path, apiserver: Any, cli: Cli
) -> None:
    kubeconfig = apiserver.kubeconfig(tmp_path)
    launch(cli, kubeconfig, "k8s.nnodes=2", "k8s.workload=statefulset")  # restartPolicy Always: in-place restarts
    first, second = apiserver.pod("tiny", 0), apiserver.pod("tiny", 1)
    hang = _incident("hang", 3, 330, T0, "no rank advanced for 30s; rank 3 did not answer (process state T); "
                     "workers ended")
    apiserver.start(first, _progress(330, 600) + hang + "resuming from step 320\n" + _progress(340, 500))
    apiserver.start(second, "[entrypoint] node 1/2\n", node="node-b")
    apiserver.restart(second, 1, _incident("oom", 5, 352, T0 + 60, "killed by SIGKILL"))  # its launcher died
    apiserver.write_log(second, "[entrypoint] node 1/2\n")
    code, out, err = cli("k8s", "status", "tiny", "--kubeconfig", str(kubeconfig))
    assert code == 0, err
    assert out.splitlines()[2] == ("  last incident: oom on rank 5 at step 352 (2026-11-18T11:07:40Z): "
                                   "killed by SIGKILL [tiny-1, previous container]")
    assert [r["query"].get("previous") for r in apiserver.requests if r["path"].endswith("/log")] == [
        None, None, ["true"]]  # only the container that restarted is asked for its previous instance
    asked = len(apiserver.requests)
    code, out, _ = cli("k8s", "list", "--kubeconfig", str(kubeconfig))  # the idle marker's logs, no earlier ones
    assert code == 0 and out.startswith("ml/tiny  statefulset  running")
    assert not any(r["query"].get("previous") for r in apiserver.requests[asked:])
    apiserver.write_log(first, _incident("preempted", None, 350, T0 + 120, "SIGTERM to the launcher; run status "
                                         "stopped; latest checkpoint step-000350"))
    status = json.loads(cli("k8s", "status", "tiny", "--kubeconfig", str(kubeconfig), "--json")[1])
    assert status["last_incident"] == {
        "kind": "preempted", "rank": None, "step": 350, "time": T0 + 120, "log": "tiny-0",
        "message": "SIGTERM to the launcher; run status stopped; latest checkpoint step-000350"}


def test_the_incident_that_ended_a_replaced_pod_is_read_from_its_log(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    kubeconfig = apiserver.kubeconfig(tmp_path)
    launch(cli, kubeconfig)
    first = apiserver.pod("tiny", 0)
    apiserver.start(first, _progress(130, 600, slowest=None))
    apiserver.exit(first, 1, _incident("hang", 0, 130, T0, "no rank advanced for 30s; rank 0 advanced least "
                                       "(process state S); workers ended") + "error: hang at step 130: ...\n")
    replacement = apiserver.pod("tiny", 0)
    apiserver.start(replacement, "resuming from step 120\n" + _progress(121, 700, slowest=None))
    status = json.loads(cli("k8s", "status", "tiny", "--kubeconfig", str(kubeconfig), "--json")[1])
    assert (status["step"], status["pods"][0]["earlier_failed"]) == (121, 1)
    incident = status["last_incident"]
    assert (incident["kind"], incident["rank"], incident["step"], incident["log"]) == ("hang", 0, 130,
                                                                                        f"{first}, replaced")
    apiserver.answer("GET", f"{PODS}/{first}/log", 500, {"kind": "Status", "message": "node gone"})
    code, out, err = cli("k8s", "status", "tiny", "--kubeconfig", str(kubeconfig))
    assert code == 0, err  # an earlier log that cannot be read is history: the status goes on without it
    assert out.splitlines()[0] == ("tiny (indexed-job, namespace ml): running, step 121/200 (60.5%), 12,345 tok/s, "
                                   "eta 11:40")
    assert "last incident" not in out


def test_an_oom_killed_pod_is_named_with_its_limit_and_advice_and_is_the_oom_incident(
        tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    """The container's cgroup was OOM-killed (exit 137, reason OOMKilled): status said `failed, step unknown` and
    the incident `worker-exit` (the peer's launcher's); `logs -f` ended with BackoffLimitExceeded only."""
    kubeconfig = apiserver.kubeconfig(tmp_path)
    launch(cli, kubeconfig, "k8s.nnodes=2", "k8s.backoff_limit=0", "k8s.resources.memory=3Gi")
    zero, one = apiserver.pod("tiny", 0), apiserver.pod("tiny", 1)
    apiserver.start(zero, _incident("worker-exit", 0, 3, T0, "a peer went away") + "error: rank 0 failed\n")
    apiserver.start(one, "[entrypoint] node 1/2\n", node="node-b")
    apiserver.exit(one, 137, reason="OOMKilled")  # its launcher died with it: no incident line of its own
    apiserver.exit(zero, 1)
    status = json.loads(cli("k8s", "status", "tiny", "--kubeconfig", str(kubeconfig), "--json")[1])
    assert status["state"] == "failed"
    failure = status["last_failure"]
    assert (failure["rank"], failure["pod"], failure["reason"], failure["exit_code"]) == (1, one, "OOMKilled", 137)
    assert failure["message"].startswith(f"rank 1: container trainer of pod {one} was OOMKilled (exit 137) at its "
                                         "memory limit of 3Gi: a pod's processes need about ")
    assert "`kubetrain doctor CONFIG` shows it); raise k8s.resources.memory" in failure["message"]
    incident = status["last_incident"]
    assert (incident["kind"], incident["rank"], incident["log"]) == ("oom", 1, f"{one}, containerStatuses")
    code, out, _ = cli("k8s", "status", "tiny", "--kubeconfig", str(kubeconfig))
    assert f"  last failure: {failure['message']}" in out.splitlines()
    assert "  last incident: oom on rank 1 (" in out
    code, out, err = cli("k8s", "logs", "tiny", "-f", "--kubeconfig", str(kubeconfig))
    assert code == 1 and err == ("error: job 'tiny' failed: BackoffLimitExceeded: Job has reached the specified "
                                 f"backoff limit; {failure['message']}\n")


def test_an_evicted_pod_is_named_and_does_not_fail_the_job(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    kubeconfig = apiserver.kubeconfig(tmp_path)
    launch(cli, kubeconfig, "k8s.backoff_limit=0")
    pod = apiserver.pod("tiny", 0)
    apiserver.start(pod, "step 1/8\n")
    apiserver.evict(pod, "The node was low on resource: memory. Threshold quantity: 100Mi, available: 42Mi.")
    status = json.loads(cli("k8s", "status", "tiny", "--kubeconfig", str(kubeconfig), "--json")[1])
    assert status["state"] == "pending: not scheduled yet"  # replaced: the DisruptionTarget rule ignores it
    assert status["last_failure"]["message"] == (
        f"rank 0: container trainer of pod {pod} was evicted from node node-a: The node was low on resource: "
        "memory. Threshold quantity: 100Mi, available: 42Mi.")


def test_a_pod_that_exited_with_a_code_and_one_that_cannot_pull_its_image_are_named(
        tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    kubeconfig = apiserver.kubeconfig(tmp_path)
    launch(cli, kubeconfig, "k8s.backoff_limit=0")
    pod = apiserver.pod("tiny", 0)
    apiserver.start(pod, "step 1/8\n")
    apiserver.exit(pod, 3)
    code, out, err = cli("k8s", "status", "tiny", "--kubeconfig", str(kubeconfig))
    assert out.splitlines()[0] == "tiny (indexed-job, namespace ml): failed, step 1/8 (12.5%)"
    assert f"  last failure: rank 0: container trainer of pod {pod} exited 3" in out.splitlines()
    code, out, err = cli("k8s", "logs", "tiny", "-f", "--kubeconfig", str(kubeconfig))
    assert code == 1 and err.endswith(f"; rank 0: container trainer of pod {pod} exited 3\n")
    kubeconfig = apiserver.kubeconfig(tmp_path)
    apiserver.objects.clear()
    launch(cli, kubeconfig)
    pod = apiserver.pod("tiny", 0)
    apiserver.schedule(pod)
    image = apiserver.objects[f"/api/v1/namespaces/ml/pods/{pod}"]["spec"]["containers"][0]["image"]
    pulling = {"reason": "ImagePullBackOff", "message": f'Back-off pulling image "{image}"'}
    apiserver.objects[f"/api/v1/namespaces/ml/pods/{pod}"]["status"]["containerStatuses"][0]["state"] = {
        "waiting": pulling}
    status = json.loads(cli("k8s", "status", "tiny", "--kubeconfig", str(kubeconfig), "--json")[1])
    assert status["last_failure"]["message"] == (
        f"rank 0: container trainer of pod {pod} cannot pull image {image} (ImagePullBackOff: Back-off pulling "
        f'image "{image}")')


@pytest.mark.parametrize("code", [69, 75])
def test_a_pod_the_failure_policy_ignores_is_no_earlier_failure(
        tmp_path: Path, apiserver: Any, cli: Cli, code: int) -> None:
    """The rendered podFailurePolicy ignores a pod that lost its rendezvous host (69) or stopped after its
    checkpoint (75), so the Job does not count them against backoffLimit; status must not count them as failed pods."""
    kubeconfig = apiserver.kubeconfig(tmp_path)
    launch(cli, kubeconfig)
    first = apiserver.pod("tiny", 0)
    apiserver.start(first, "step 10/20 | loss 3.1\n")
    apiserver.exit(first, code)
    replacement = apiserver.pod("tiny", 0)
    assert replacement != first
    apiserver.start(replacement, "step 12/20 | loss 3.0\n")
    apiserver.exit(replacement, 1)  # this one counts
    third = apiserver.pod("tiny", 0)
    apiserver.start(third, "step 13/20 | loss 2.9\n")
    status = json.loads(cli("k8s", "status", "tiny", "--kubeconfig", str(kubeconfig), "--json")[1])
    assert (status["pods"][0]["name"], status["pods"][0]["earlier_failed"]) == (third, 1)


def test_after_a_restart_in_the_pod_the_step_is_the_resumed_one_without_the_old_eta(
        tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    """The hang at step 90 ended the workers, which resumed from step 50 in the same pod; the last
    progress line (step 90, its rate and ETA) is from before: the run is at step 50 until it logs a step again."""
    kubeconfig = apiserver.kubeconfig(tmp_path)
    launch(cli, kubeconfig)
    pod = apiserver.pod("tiny", 0)
    apiserver.start(pod, _progress(90, 600, slowest=None)
                    + _incident("hang", 0, 90, T0, "no rank advanced for 60s; rank 0 did not answer")
                    + "[rank 0] resuming from /ckpt/tiny/checkpoints/step-000050 (step 50, 12,800 tokens)\n")
    code, out, err = cli("k8s", "status", "tiny", "--kubeconfig", str(kubeconfig))
    assert code == 0, err
    assert out.splitlines()[0] == "tiny (indexed-job, namespace ml): running, step 50/200 (25%)"
    apiserver.write_log(pod, _progress(52, 700, slowest=None))
    status = json.loads(cli("k8s", "status", "tiny", "--kubeconfig", str(kubeconfig), "--json")[1])
    assert (status["step"], status["eta_seconds"]) == (52, 700)
    apiserver.write_log(pod, _incident("hang", 0, 60, T0 + 100, "no rank advanced for 60s; rank 0 did not answer"))
    status = json.loads(cli("k8s", "status", "tiny", "--kubeconfig", str(kubeconfig), "--json")[1])
    assert (status["step"], status["eta_seconds"], status["tokens_per_second"]) == (52, None, None)


def _preflight_log(problem: str | None) -> str:
    """Rank 0's preflight lines as distributed/preflight.py prints them (its table, then the verdict)."""
    from kubetrain.distributed.preflight import table

    rank = {"pod": "tiny-0", "node": "gpu-a", "device": {"device": "cuda:0", "ok": True, "matmul": {
        "relative_error": 2e-4}, "memory": {"ok": True}}, "all_reduce": {"busbw": 11.8e9, "latency_seconds": 3e-5},
        "links": [[1, 20e9]], "clock_offset_seconds": 0.0}
    report = {"world_size": 2, "backend": "nccl", "seconds": 6.4, "budget_seconds": 20, "all_reduce_bytes": 2**28,
              "link_bytes": 2**28, "ranks": [{**rank, "rank": 0}, {**rank, "rank": 1, "pod": "tiny-1"}],
              "verdict": {"ok": problem is None}, "all_reduce_busbw": 11.8e9, "median_link_bandwidth": 20e9,
              "link_classes": {"across nodes": {"links": 1, "median": 20e9, "floor": None}}}
    lines = [f"[rank 0] {line}" for line in table(report)]
    if problem:
        lines += [_incident("preflight", 1, 0, T0, problem).strip(), f"error: {problem}"]
    return "\n".join(lines) + "\n"


def test_status_shows_the_preflight_and_the_rank_it_stopped_the_job_for(
        tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    kubeconfig = apiserver.kubeconfig(tmp_path)
    launch(cli, kubeconfig, "k8s.nnodes=2")
    first, second = apiserver.pod("tiny", 0), apiserver.pod("tiny", 1)
    apiserver.start(first, _preflight_log(None) + _progress(20, 600))
    apiserver.start(second, "[entrypoint] node 1/2\n", node="gpu-b")
    code, out, err = cli("k8s", "status", "tiny", "--kubeconfig", str(kubeconfig))
    assert code == 0, err
    assert ("  preflight: ok in 6.4 s over 2 ranks (nccl): job all-reduce 11.8 GB/s, send/recv median across nodes "
            "20 GB/s" in out.splitlines())
    # a rank is named for what is about it (its device, its links), never for the job's all-reduce
    problem = "preflight: rank 1 (pod tiny-1, node gpu-b): device cuda:0: matmul off by 0.3 (tolerance 0.01)"
    apiserver.write_log(first, _preflight_log(problem))
    status = json.loads(cli("k8s", "status", "tiny", "--kubeconfig", str(kubeconfig), "--json")[1])
    assert status["preflight"]["ok"] is False and status["preflight"]["problem"] == problem
    assert status["last_incident"]["kind"] == "preflight" and status["last_incident"]["rank"] == 1

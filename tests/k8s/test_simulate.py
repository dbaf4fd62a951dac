"""Local pod simulation: each pod gets its controller's environment; 2-pod jobs train to the end and survive
the loss of a pod (slow tests: real processes, torchrun, gloo)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubetrain.config import load_config
from kubetrain.config.k8s import WORKLOADS
from kubetrain.k8s.pod.node import node_env
from kubetrain.k8s.simulate.simulation import Simulation

# A tiny run: 2 layers x 32 wide, 1 thread per process, no samples, cheap evals.
TINY = [
    "run.threads=1", "run.device=cpu", "model.n_layer=2", "model.n_head=2", "model.n_embd=32",
    "model.block_size=32", "train.micro_batch_size=4", "train.warmup_steps=2", "train.log_every_steps=4",
    "eval.windows=1", "eval.sample_prompt=null", "k8s.nnodes=2",
]


def sim(tmp_path: Path, workload: str, *more: str) -> Simulation:
    cfg = load_config(None, "tiny", [*TINY, *more])
    return Simulation(cfg, tmp_path / "sim", workload, echo=False)


@pytest.mark.parametrize("workload", WORKLOADS)
def test_each_pod_reads_its_node_rank_from_its_controllers_env(tmp_path: Path, workload: str) -> None:
    s = sim(tmp_path, workload, "k8s.nnodes=3", "k8s.nproc_per_node=2")
    assert len(s.pods) == 3
    for rank, pod in enumerate(s.pods):
        node = node_env(pod.env)
        assert (node.node_rank, node.nnodes, node.nproc_per_node) == (rank, 3, 2), pod.name
        assert (node.master_addr, node.master_port) == ("127.0.0.1", s.port), pod.name
        assert pod.env["KUBETRAIN_POD_IP"] == "127.0.0.1"
        # the downward API's pod and node names, which the preflight's verdict names a rank by
        assert pod.env["KUBETRAIN_POD_NAME"] == pod.name and pod.env["KUBETRAIN_NODE_NAME"] == socket.gethostname()
        assert pod.env["HOME"] == str(pod.folder / "tmp")  # emptyDirs are the pod's own folders
        config = pod.argv[pod.argv.index("--config") + 1]
        assert config == str(pod.folder / "configmap" / "config.yaml")  # its copy: its own ports
        prometheus = yaml.safe_load(Path(config).read_text())["track"]["prometheus"]
        assert prometheus["port"] == pod.ports["metrics"] and pod.ports["launcher"] == pod.ports["metrics"] + 1
    # one host for all pods: no two pods listen on one port (the second launcher's was "Address already in use")
    ports = [port for pod in s.pods for name, port in pod.ports.items() if name in ("metrics", "launcher")]
    assert len(ports) == len(set(ports)) == 2 * len(s.pods)
    names = [p.name for p in s.pods]
    expected = {"pytorchjob": ["tiny-master-0", "tiny-worker-0", "tiny-worker-1"],
                "jobset": ["tiny-node-0-0", "tiny-node-0-1", "tiny-node-0-2"],
                "trainjob": ["tiny-node-0-0", "tiny-node-0-1", "tiny-node-0-2"]}
    assert names == expected.get(workload, ["tiny-0", "tiny-1", "tiny-2"])


def test_volumes_map_to_shared_local_folders(tmp_path: Path) -> None:
    s = sim(tmp_path, "indexed-job", 'k8s.volumes.data={"claim": "corpus"}', "data.cache_dir=/data/shards")
    for pod in s.pods:
        config = yaml.safe_load((pod.folder / "configmap" / "config.yaml").read_text())
        assert config["run"]["output_dir"] == str(s.root / "volumes" / "checkpoints")
        assert config["data"]["cache_dir"] == str(s.root / "volumes" / "data" / "shards")


def test_a_claim_bound_to_a_local_folder_and_an_input_on_an_unbound_claim(tmp_path: Path) -> None:
    """--volume NAME=PATH binds a folder of this machine to a claim (by its volume or claim name); an input of the
    config on a claim with nothing there is refused before any pod starts, naming the claim and the flag."""
    from kubetrain.errors import UserInputError

    corpus = tmp_path / "corpora"
    (corpus / "corpus").mkdir(parents=True)
    (corpus / "corpus" / "a.txt").write_text("In the beginning " * 200)
    data = ['k8s.volumes.data={"claim": "corpora", "read_only": true}',
            'data.sources=[{"kind": "text", "path": "/data/corpus/*.txt"}]']
    with pytest.raises(UserInputError) as refused:
        sim(tmp_path, "indexed-job", *data)
    message = str(refused.value)
    assert "data.sources.0.path (/data/corpus/*.txt)" in message and "claim 'corpora'" in message
    assert "--volume data=PATH" in message
    cfg = load_config(None, "tiny", [*TINY, *data])
    for name in ("data", "corpora"):
        s = Simulation(cfg, tmp_path / f"sim-{name}", "indexed-job", echo=False, volumes={name: corpus})
        config = yaml.safe_load((s.pods[1].folder / "configmap" / "config.yaml").read_text())
        assert config["data"]["sources"][0]["path"] == f"{corpus}/corpus/*.txt"
    with pytest.raises(UserInputError, match="no claim or volume of that name"):
        Simulation(cfg, tmp_path / "sim-x", "indexed-job", echo=False, volumes={"dataa": corpus})
    done = subprocess.run([sys.executable, "-m", "kubetrain", "k8s", "simulate", "--root", str(tmp_path / "cli"),
                           *[a for item in [*TINY, *data] for a in ("--set", item)]],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "--volume data=PATH" in done.stderr


def test_a_volume_bound_twice_or_badly_is_refused_in_the_users_own_words(tmp_path: Path) -> None:
    """`--volume corpora=A --volume corpora=B` let the last win silently; a bad folder for `corpora` was named
    `data` (the volume's name, not the one the user typed)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    base = ["k8s", "simulate", "--root", str(tmp_path / "cli"), *[a for item in TINY for a in ("--set", item)],
            "--set", 'k8s.volumes.data={"claim": "corpora", "read_only": true}']
    for extra, message in (
        (["--volume", f"corpora={tmp_path / 'a'}", "--volume", f"corpora={tmp_path / 'b'}"],
         f"--volume corpora is given twice ({tmp_path / 'a'} and {tmp_path / 'b'})"),
        (["--volume", f"corpora={tmp_path / 'missing'}"], f"--volume corpora={tmp_path / 'missing'}: not a folder"),
        (["--volume", f"data={tmp_path / 'a'}", "--volume", f"corpora={tmp_path / 'b'}"],
         "bind the same claim to two folders"),
    ):
        done = subprocess.run([sys.executable, "-m", "kubetrain", *base, *extra], capture_output=True, text=True,
                              check=False)
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        assert message in done.stderr, done.stderr


def finished_meta(s: Simulation) -> dict[str, Any]:
    meta: dict[str, Any] = json.loads((s.root / "volumes" / "checkpoints" / "tiny" / "meta.json").read_text())
    return meta


@pytest.mark.slow
@pytest.mark.ci  # a heavy end-to-end proof (many processes): .ci/run runs it, not the README's test command
def test_indexed_job_of_two_pods_trains_to_the_end(tmp_path: Path) -> None:
    sets = [a for item in [*TINY, "train.max_steps=12", "checkpoint.every_steps=4"] for a in ("--set", item)]
    done = subprocess.run(
        [sys.executable, "-m", "kubetrain", "k8s", "simulate", "--root", str(tmp_path / "sim"), *sets,
         "--timeout", "300"],
        capture_output=True, text=True, check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "ok: all 2 pods succeeded" in done.stdout
    assert "[tiny-1] [entrypoint] node 1/2 (indexed-job)" in done.stdout
    assert "Address already in use" not in done.stdout  # each simulated pod's launcher has its own port
    meta = json.loads((tmp_path / "sim" / "volumes" / "checkpoints" / "tiny" / "meta.json").read_text())
    assert meta["status"] == "finished" and meta["step"] == 12 and meta["world_size"] == 2


@pytest.mark.slow
def test_pytorchjob_of_two_pods_trains_to_the_end(tmp_path: Path) -> None:
    s = sim(tmp_path, "pytorchjob", "train.max_steps=8", "checkpoint.every_steps=4")
    result = s.run(timeout=300)
    assert result.succeeded, result.message + (s.pods[0].log_path.read_text()[-3000:])
    assert result.exit_codes == {"tiny-master-0": [0], "tiny-worker-0": [0]}
    meta = finished_meta(s)
    assert meta["status"] == "finished" and meta["step"] == 8 and meta["world_size"] == 2


@pytest.mark.slow
@pytest.mark.ci  # a heavy end-to-end proof (many processes): .ci/run runs it, not the README's test command
def test_a_lost_pod_is_replaced_and_the_run_resumes_from_the_shared_checkpoint(tmp_path: Path) -> None:
    steps = 200
    s = sim(tmp_path, "indexed-job", f"train.max_steps={steps}", "checkpoint.every_steps=20",
            "eval.every_steps=100")
    s.start()
    latest = s.root / "volumes" / "checkpoints" / "tiny" / "checkpoints" / "latest"
    deadline = time.monotonic() + 300  # a safety net against a hang, not a timing assertion
    while not latest.exists():
        assert time.monotonic() < deadline, s.pods[0].log_path.read_text()[-3000:]
        assert all(p.running() for p in s.pods), [p.log_path.read_text()[-2000:] for p in s.pods]
        time.sleep(0.2)
    assert s.pod(1).running()  # the kill lands mid-run
    s.kill(1)  # the node of pod 1 is gone: its torchrun and worker die at once
    result = s.run(timeout=300)  # like the Job controller: a replacement pod with the same index
    logs = "".join(p.log_path.read_text() for p in s.pods)
    assert result.succeeded, result.message + logs[-4000:]
    assert result.exit_codes["tiny-1"] == [-9, 0] and result.exit_codes["tiny-0"] == [0]
    assert "resuming from" in logs
    meta = finished_meta(s)
    assert meta["status"] == "finished" and meta["step"] == steps
    # node 0's launcher (global rank 0's) lived on: its workers were restarted, not started anew
    assert (meta["starts"], meta["worker_restarts"] >= 1) == (1, True)


@pytest.mark.slow
@pytest.mark.ci  # a heavy end-to-end proof (many processes): .ci/run runs it, not the README's test command
def test_a_simulated_job_is_fetched_and_works_here(tmp_path: Path) -> None:
    """`k8s fetch`'s copy of a whole 2-pod job, then runs/generate/export and MLflow on it and a local resume from it.

    No real pod can exist here: the pod program runs as a local process on the simulated claim (LocalTransport),
    the same program and the same local code path that exec in a pod feeds (tests/k8s/fetch/test_pods.py).
    """
    from mlflow.tracking import MlflowClient

    from kubetrain.k8s.fetch.transfer import LocalTransport, fetch_run
    from tests.conftest import cli_env

    s = sim(tmp_path, "indexed-job", "train.max_steps=8", "checkpoint.every_steps=4", "eval.every_steps=4",
            "track.mlflow.enabled=true")
    result = s.run(timeout=300)
    assert result.succeeded, result.message + s.pods[0].log_path.read_text()[-3000:]
    local = tmp_path / "laptop" / "runs" / "tiny"
    claim = s.root / "volumes" / "checkpoints"
    fetched = fetch_run(LocalTransport(), str(claim / "tiny"), local, "all", mlflow_db=str(claim / "mlflow.db"))
    assert fetched.failed == [] and [Path(c).name for c in fetched.checkpoints] == ["step-000004", "step-000008"]
    assert fetched.mlflow_store is not None and len(fetched.mlflow_runs) == 1, fetched.warnings
    client = MlflowClient(f"sqlite:///{fetched.mlflow_store}")
    assert max(m.step for m in client.get_metric_history(fetched.mlflow_runs[0], "loss")) == 8
    assert {a.path for a in client.list_artifacts(fetched.mlflow_runs[0])} == {"config.yaml", "meta.json"}

    def kubetrain(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "kubetrain", *args], cwd=tmp_path / "laptop", env=cli_env(),
                              capture_output=True, text=True, check=False, timeout=300)

    listed = kubetrain("runs", "list", "runs")
    assert listed.returncode == 0 and "tiny" in listed.stdout, listed.stderr
    assert kubetrain("runs", "show", "runs/tiny").returncode == 0
    generated = kubetrain("generate", "runs/tiny", "--prompt", "And", "--max-new-tokens", "4", "--seed", "1")
    assert generated.returncode == 0 and generated.stdout.startswith("And"), generated.stderr
    exported = kubetrain("export", "runs/tiny", "--format", "hf", "-o", "hf")
    assert exported.returncode == 0 and (tmp_path / "laptop" / "hf" / "config.json").is_file(), exported.stderr
    sets = [a for item in [*TINY, "train.max_steps=12", "checkpoint.every_steps=4", "eval.every_steps=4",
                           "run.output_dir=runs", "run.name=tiny"] for a in ("--set", item)]
    resumed = kubetrain("train", *sets, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert f"resuming from {Path('runs') / 'tiny' / 'checkpoints' / 'step-000008'} (step 8" \
        in resumed.stdout + resumed.stderr
    meta = json.loads((local / "meta.json").read_text())
    assert meta["status"] == "finished" and meta["step"] == 12


# A container whose /healthz answers 200 twice, then 503 (a launcher whose ranks stopped finishing steps).
STALE_AFTER_TWO = """
import http.server, sys
answered = []
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        answered.append(self.path)
        self.send_response(200 if len(answered) <= 2 else 503)
        self.end_headers()
        self.wfile.write(b"{}")
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def test_the_kubelet_ends_a_container_whose_liveness_probe_fails(tmp_path: Path) -> None:
    """The simulated kubelet probes as rendered (periods shortened here): the startup probe passes, then three
    liveness failures in a row end the container with SIGTERM, as the kubelet does."""
    import signal

    said: list[str] = []
    s = Simulation(load_config(None, "tiny", [*TINY, "k8s.nnodes=1"]), tmp_path / "sim", "indexed-job",
                   log=said.append, echo=False)
    pod = s.pods[0]
    assert pod.probes["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "launcher"}
    pod.argv = [sys.executable, "-c", STALE_AFTER_TWO, str(pod.ports["launcher"])]
    pod.probes = {kind: {**spec, "periodSeconds": 0.2} for kind, spec in pod.probes.items()}
    s.start_pod(0)
    assert pod.process is not None
    assert pod.process.wait(timeout=120) == -signal.SIGTERM
    [ended] = [line for line in said if "the kubelet ends the container" in line]
    assert "livenessProbe failed 3 times" in ended and "statuscode: 503" in ended, said


@pytest.mark.ci  # minutes of processes together with its peers: .ci/run runs it, not the README's test command
@pytest.mark.slow
def test_a_rank_stopped_after_an_elastic_restart_is_named_by_its_pod(tmp_path: Path) -> None:
    """In two pods: SIGKILL the worker of rank 1, let both agents restart and resume, SIGSTOP the new rank
    0. The node whose worker was only stopped by its agent (a membership change: its restart count stays) watched
    the new round as if it were handled, so the healthy rank was blamed and the frozen one's pod said nothing."""
    import os
    import signal

    from kubetrain.k8s.simulate.simulation import _descendants
    from kubetrain.runs.incidents import read_all
    from tests.launch.test_watch import _beat_of
    from tests.train.conftest import rank_of

    s = sim(tmp_path, "indexed-job", "train.max_steps=100000", "checkpoint.every_steps=5", "eval.every_steps=100000",
            "dist.hang_timeout_seconds=8")
    run = s.root / "volumes" / "checkpoints" / "tiny"

    def workers() -> dict[int, int]:  # pid -> global rank, of every pod's running workers
        pids = [pid for p in s.pods if p.process is not None for pid in _descendants(p.process.pid) or []]
        return {pid: rank for pid in pids if (rank := rank_of(pid)) is not None}

    def logs() -> str:
        return "".join(p.log_path.read_text() for p in s.pods if p.log_path.exists())

    def until(ready: Any, what: str) -> None:
        deadline = time.monotonic() + 300  # a safety net against a hang, not a timing assertion
        while not ready():
            assert time.monotonic() < deadline, f"waited for {what}:\n{logs()[-4000:]}"
            assert all(p.running() for p in s.pods), logs()[-4000:]
            time.sleep(0.2)

    s.start()
    try:
        until((run / "checkpoints" / "latest").exists, "a checkpoint")
        first = workers()
        os.kill(next(pid for pid, rank in first.items() if rank == 1), signal.SIGKILL)

        def resumed_rank0() -> int | None:
            for pid, rank in workers().items():
                beat = _beat_of(pid) if pid not in first else None
                if rank == 0 and beat is not None and beat.pid == pid and beat.step >= 0:
                    return pid
            return None

        until(lambda: resumed_rank0() is not None and "resuming from" in logs(), "the resumed rank 0")
        rank0 = resumed_rank0()
        assert rank0 is not None
        os.kill(rank0, signal.SIGSTOP)
        until(lambda: any(e["kind"] == "hang" for e in read_all(run)), "the hang incident")
        # the healthy pod's launcher names the same suspect, on the other node: after the incident, or before
        until(lambda: "the stuck rank is rank 0 on another node" in logs(), "the healthy pod's line")
    finally:
        s.stop()
    found = read_all(run)
    said = [line for line in logs().splitlines() if "incident:" in line or "launcher:" in line]
    assert [(e["kind"], e["rank"]) for e in found] == [("worker-exit", 1), ("hang", 0)], said
    hang = found[-1]
    assert "rank 0 did not answer" in hang["message"], hang
    stacks = (run / hang["stacks"]).read_text()
    assert stacks.startswith("hang: ") and "suspect: rank 0\n" in stacks and "no stacks: it is stopped" in stacks

"""The pod entrypoint: torchrun's command line, waiting for the rendezvous endpoint, bad input."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kubetrain.cli import main
from kubetrain.config import load_config
from kubetrain.errors import UserInputError
from kubetrain.k8s.pod import entrypoint
from kubetrain.k8s.pod.node import NodeEnv
from kubetrain.k8s.simulate.simulation import Simulation


def node(rank: int) -> NodeEnv:
    return NodeEnv(rank, 4, 8, "job-0.job", 29500, "indexed-job")


def test_elastic_agent_command_line() -> None:
    from kubetrain.launch.elastic import torchrun_args

    opts = entrypoint.launch_options(node(0), rdzv_id="job", max_restarts=5, shutdown_timeout=120,
                                     local_addr="10.0.0.7")
    line = " ".join(torchrun_args(opts, ["/etc/kubetrain/config.yaml", "--resume", "auto"]))
    for part in ("--nproc-per-node=8", "--max-restarts=5", "--shutdown-timeout=120", "--nnodes=4",
                 "--rdzv-backend=c10d", "--rdzv-endpoint=job-0.job:29500", "--rdzv-id=job",
                 "--rdzv-conf=is_host=true", "--local-addr=10.0.0.7"):
        assert part in line
    assert line.endswith("--module kubetrain train /etc/kubetrain/config.yaml --resume auto")
    other = " ".join(torchrun_args(entrypoint.launch_options(node(3), rdzv_id="job", max_restarts=0,
                                                             shutdown_timeout=90), []))
    assert "is_host=false" in other and "--local-addr" not in other


def test_wait_returns_once_the_endpoint_accepts() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        lines: list[str] = []
        entrypoint.wait_for_endpoint("127.0.0.1", port, timeout=30, log=lines.append)
    assert lines == [f"rendezvous endpoint 127.0.0.1:{port} is up"]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_wait_gives_up_naming_the_endpoint() -> None:
    port = closed_port()
    with pytest.raises(entrypoint.RendezvousUnreachable, match=f"127.0.0.1:{port} did not accept"):
        entrypoint.wait_for_endpoint("127.0.0.1", port, timeout=0.2, log=lambda m: None, interval=0.05)
    with pytest.raises(entrypoint.RendezvousUnreachable, match="gaierror"):
        entrypoint.wait_for_endpoint("rank0.does-not-exist.invalid", port, timeout=0, log=lambda m: None)


def test_unreadable_node_rank_is_bad_input(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBETRAIN_NNODES", "2")
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "five")
    with pytest.raises(UserInputError, match="JOB_COMPLETION_INDEX"):
        entrypoint.read_node()


def test_cli_bad_config_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "config.yaml"
    bad.write_text("train:\n  max_stepz: 3\n")
    with pytest.raises(SystemExit) as e:
        main(["k8s", "entrypoint", "--config", str(bad)])
    assert e.value.code == 2
    assert "unknown key 'train.max_stepz'" in capsys.readouterr().err


def test_cli_non_zero_rank_waits_then_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("run:\n  name: x\n")
    port = closed_port()
    for name, value in {"KUBETRAIN_NNODES": "2", "JOB_COMPLETION_INDEX": "1", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as e:
        main(["k8s", "entrypoint", "--config", str(config), "--wait-timeout", "0"])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert "node 1/2 (indexed-job)" in err and f"127.0.0.1:{port} did not accept connections" in err


IDLE = (
    "import sys\n"
    "from kubetrain.k8s.pod.entrypoint import idle_until_stopped\n"
    "sys.exit(idle_until_stopped(lambda: print('idling', flush=True)))\n"
)


def test_statefulset_pod_idles_until_sigterm() -> None:
    child = subprocess.Popen([sys.executable, "-c", IDLE], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    assert child.stdout.readline() == "idling\n"
    assert child.poll() is None  # still up: a StatefulSet would restart a container that exits
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=60) == 0


def _pod_past_its_first_step(tmp_path: Path, *extra: str) -> tuple[Simulation, Any]:
    """One simulated pod of a tiny endless run, once its log shows step 1."""
    tiny = ["run.threads=1", "run.device=cpu", "model.n_layer=1", "model.n_head=2", "model.n_embd=16",
            "model.block_size=16", "train.micro_batch_size=2", "train.warmup_steps=1", "train.log_every_steps=1",
            "train.max_steps=100000", "eval.every_steps=100000", "eval.sample_prompt=null", *extra]
    s = Simulation(load_config(None, "tiny", tiny), tmp_path / "sim", "indexed-job", echo=False)
    pod = s.start_pod(0)
    assert pod.process is not None
    deadline = time.monotonic() + 300  # a safety net against a hang, not a timing assertion
    while "step 1/" not in (pod.log_path.read_text() if pod.log_path.exists() else ""):
        assert pod.running() and time.monotonic() < deadline, pod.log_path.read_text()[-3000:]
        time.sleep(0.1)
    return s, pod


@pytest.mark.slow
def test_sigterm_to_the_pod_ends_it_with_75_after_a_checkpoint(tmp_path: Path) -> None:
    """The pod's main process gets SIGTERM (what the kubelet sends); its workers save and the pod exits 75."""
    s, pod = _pod_past_its_first_step(tmp_path)
    pod.process.send_signal(signal.SIGTERM)  # to the container's main process only, like the kubelet
    assert pod.process.wait(timeout=300) == 75, pod.log_path.read_text()[-3000:]
    checkpoints = s.root / "volumes" / "checkpoints" / "tiny" / "checkpoints"
    assert (checkpoints / "latest").exists(), pod.log_path.read_text()[-3000:]
    meta = json.loads((s.root / "volumes" / "checkpoints" / "tiny" / "meta.json").read_text())
    assert meta["status"] == "stopped"
    # a pod is resumed by its controller (or a launch), not by "the same command" (the rendered env says so)
    stopped = [line for line in pod.log_path.read_text().splitlines() if "stopped by SIGTERM at step" in line]
    assert len(stopped) == 1 and stopped[0].endswith(
        "; the Job starts the pod again and it resumes from there; after kubetrain k8s stop, kubetrain k8s launch "
        "resumes it"), stopped


@pytest.mark.slow
def test_a_pod_stopped_before_its_first_checkpoint_exits_75_and_says_it_lost_nothing(tmp_path: Path) -> None:
    """A pod deleted or preempted before the run's first checkpoint exited 1, a failure the Job counts (four of
    them failed a job that had lost nothing). With no checkpoint there is nothing to lose: 75, which the rendered
    podFailurePolicy ignores, and the log says so. The save cannot finish within a grace of 10 ms."""
    s, pod = _pod_past_its_first_step(tmp_path, "checkpoint.every_steps=100000", "checkpoint.grace_seconds=0.01")
    pod.process.send_signal(signal.SIGTERM)
    log = pod.log_path.read_text
    assert pod.process.wait(timeout=300) == 75, log()[-3000:]
    assert not (s.root / "volumes" / "checkpoints" / "tiny" / "checkpoints" / "latest").exists()
    assert ("launcher: SIGTERM: stopped before the first checkpoint: nothing to lose, the run starts over; exiting "
            "75, not a failure (the Job starts the pod again and it resumes from there; after kubetrain k8s stop, "
            "kubetrain k8s launch resumes it)") in log().splitlines(), log()[-3000:]
    rules = s.workload_obj["spec"]["podFailurePolicy"]["rules"]
    assert any(r["action"] == "Ignore" and 75 in (r.get("onExitCodes") or {}).get("values", []) for r in rules)


@pytest.mark.slow
@pytest.mark.ci  # a heavy end-to-end proof (many processes): .ci/run runs it, not the README's test command
def test_a_pod_that_lost_its_rendezvous_host_exits_69_which_the_job_ignores(tmp_path: Path) -> None:
    """Node rank 0's pod is lost (it hosts the c10d store): the other pod exits 69, which the rendered
    podFailurePolicy ignores, so with backoffLimit 1 the job survives (the lost pod is its one failure)."""
    from kubetrain.errors import EXIT_PEER_LOST

    tiny = ["run.threads=1", "run.device=cpu", "model.n_layer=1", "model.n_head=2", "model.n_embd=16",
            "model.block_size=16", "train.micro_batch_size=2", "train.warmup_steps=1", "train.log_every_steps=10",
            "train.max_steps=40", "checkpoint.every_steps=10", "eval.every_steps=100000", "eval.sample_prompt=null",
            "k8s.nnodes=2", "k8s.backoff_limit=1"]
    s = Simulation(load_config(None, "tiny", tiny), tmp_path / "sim", "indexed-job", echo=False)
    s.start()
    latest = s.root / "volumes" / "checkpoints" / "tiny" / "checkpoints" / "latest"
    deadline = time.monotonic() + 300  # a safety net against a hang, not a timing assertion
    while not latest.exists():
        assert time.monotonic() < deadline and all(p.running() for p in s.pods), s.pod(1).log_path.read_text()[-3000:]
        time.sleep(0.2)
    s.kill(0)  # the node of rank 0 is gone, and the rendezvous store with it
    one = s.pod(1).process
    assert one is not None
    assert one.wait(timeout=300) == EXIT_PEER_LOST, s.pod(1).log_path.read_text()[-3000:]
    survivor = s.pod(1).log_path.read_text()
    assert "lost the rendezvous host" in survivor
    # the loss is the survivor's one incident (not its rank's "a peer went away"), and no C++ frames
    assert [line.split(" ")[1] for line in survivor.splitlines() if line.startswith("incident:")] == [
        "rendezvous-lost"], survivor[-3000:]
    assert "frame #" not in survivor, survivor[-3000:]
    result = s.run(timeout=300)  # the controller replaces both: rank 0's loss counts, rank 1's exit does not
    logs = "".join(p.log_path.read_text() for p in s.pods)
    assert result.succeeded, result.message + logs[-4000:]
    assert result.exit_codes == {"tiny-0": [-9, 0], "tiny-1": [EXIT_PEER_LOST, 0]}


def test_a_pod_whose_rendezvous_another_agent_closed_says_so_in_one_line_and_exits_69(tmp_path: Path) -> None:
    """Another node's agent gave up and closed the rendezvous (torch's launch_agent shuts its handler down); this
    pod's agent, joining the next round, meets RendezvousClosedError: ~80 lines of traceback and exit 1 before.
    The closed rendezvous is torch's own: a host handler on a real c10d store, shut down."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    from kubetrain.errors import EXIT_PEER_LOST
    from tests.conftest import cli_env

    port = closed_port()
    host = get_rendezvous_handler(RendezvousParameters(
        backend="c10d", endpoint=f"127.0.0.1:{port}", run_id="tiny", min_nodes=2, max_nodes=2, is_host="true"))
    host.shutdown()  # what the agent that gave up does on its way out: the state says closed
    config = tmp_path / "config.yaml"
    config.write_text(f"run:\n  name: tiny\n  output_dir: {tmp_path / 'runs'}\n")
    env = {**cli_env(), "KUBETRAIN_NNODES": "2", "JOB_COMPLETION_INDEX": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    proc = subprocess.run([sys.executable, "-m", "kubetrain", "k8s", "entrypoint", "--config", str(config),
                           "--rdzv-id", "tiny", "--wait-timeout", "30"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == EXIT_PEER_LOST, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "RendezvousClosedError" not in proc.stderr, proc.stderr[-3000:]
    assert (f"[entrypoint] the rendezvous tiny at 127.0.0.1:{port} was closed by another node's agent (it gave "
            f"up); exiting 69 so this pod is replaced without counting as a failure") in proc.stderr.splitlines()
    incidents = [line for line in proc.stderr.splitlines() if line.startswith("incident:")]
    assert len(incidents) == 1 and incidents[0].startswith("incident: rendezvous-closed (")
    del host

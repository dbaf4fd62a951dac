"""The pod entrypoint: torchrun's command line, waiting for the rendezvous endpoint, bad input."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kubetrain.cli import main
from kubetrain.dist.env import NodeEnv
from kubetrain.errors import UserInputError
from kubetrain.k8s.pod import entrypoint


def node(rank: int) -> NodeEnv:
    return NodeEnv(rank, 4, 8, "job-0.job", 29500, "indexed-job")


def test_torchrun_command_line() -> None:
    argv = entrypoint.torchrun_argv(node(0), Path("/etc/kubetrain/config.yaml"), rdzv_id="job",
                                    max_restarts=5, local_addr="10.0.0.7", overrides=["run.output_dir=/ckpt"])
    line = " ".join(argv[1:])
    assert line.startswith("-m torch.distributed.run --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d ")
    assert "--rdzv-endpoint job-0.job:29500 --rdzv-id job --rdzv-conf is_host=true --max-restarts 5" in line
    assert "--local-addr 10.0.0.7" in line
    assert line.endswith("-m kubetrain train /etc/kubetrain/config.yaml --resume auto "
                         "--set run.output_dir=/ckpt")
    other = entrypoint.torchrun_argv(node(3), Path("c.yaml"), rdzv_id="job", max_restarts=0)
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


SUPERVISE = (
    "import sys\n"
    "from kubetrain.k8s.pod.entrypoint import supervise\n"
    "sys.exit(supervise([sys.executable, '-c', sys.argv[1]], lambda m: print(m, flush=True)))\n"
)


def test_statefulset_pod_idles_after_success_until_sigterm() -> None:
    import signal
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", SUPERVISE, "print('trained', flush=True)"],
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    assert child.stdout.readline() == "trained\n"
    assert child.stdout.readline().startswith("training finished; idling")
    assert child.poll() is None  # still up: a StatefulSet would restart a container that exits
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=60) == 0
    failed = subprocess.run([sys.executable, "-c", SUPERVISE, "raise SystemExit(3)"], capture_output=True,
                            text=True, check=False)
    assert failed.returncode == 3 and "idling" not in failed.stdout

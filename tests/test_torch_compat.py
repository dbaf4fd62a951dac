"""torch_compat: the differences between torch versions, and (marked `compat`) a smoke run of every path that
depends on them, with real processes. scripts/test-compat runs the `compat` tests on the oldest supported torch and
2.11; the main suite runs them on the torch of .venv."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from kubetrain.launch.elastic import LaunchOptions, torchrun_args
from kubetrain.torch_compat import (
    agent_takes_shutdown_timeout,
    release_destroyed_groups,
    torch_version,
    unsupported_torch,
)
from tests.conftest import cli_env
from tests.launch.test_elastic import _free_port
from tests.train.conftest import kubetrain, lines_in, sets, start, wait_until


def test_versions_read_and_the_oldest_supported_is_refused_below() -> None:
    assert torch_version("2.8.0+cu128") == (2, 8)
    assert torch_version("2.11.0a0+git1234") == (2, 11)
    assert torch_version("2.13.0") == (2, 13)
    assert unsupported_torch("2.8.0") is None and unsupported_torch("2.13.0+cpu") is None
    message = unsupported_torch("2.5.1+cu124")
    assert message is not None and ">= 2.8" in message and "2.5.1+cu124" in message
    assert unsupported_torch() is None  # the torch running this test is supported


ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_readme_dockerfiles_and_ci_name_the_same_torch_range() -> None:
    import re
    import tomllib

    from kubetrain.torch_compat import OLDEST_SUPPORTED

    oldest = ".".join(map(str, OLDEST_SUPPORTED))
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"torch>={oldest},<3" in deps
    assert f"torch {oldest} to 2.13" in (ROOT / "README.md").read_text()
    tested = re.search(r"&& versions=\((.*)\)", (ROOT / "scripts" / "test-compat").read_text())
    assert tested is not None and tested.group(1).split()[0] == f"{oldest}.0"  # CI tests the oldest it promises
    cuda = re.search(r"ARG TORCH_VERSION=(\S+)", (ROOT / "deploy" / "docker" / "Dockerfile.cuda").read_text())
    assert cuda is not None and cuda.group(1) in tested.group(1).split()  # a version CI tests
    assert '"torch==2.13.0"' in (ROOT / "deploy" / "docker" / "Dockerfile").read_text()  # the main suite's torch


def test_the_torchrun_command_line_parses_on_this_torch() -> None:
    """torch <= 2.12's torchrun refused --shutdown-timeout ("unrecognized arguments"): every pod exited 2."""
    from torch.distributed.run import parse_args

    for opts in (LaunchOptions(nproc_per_node=2, shutdown_timeout=90),
                 LaunchOptions(nproc_per_node=1, nnodes="2", rdzv_endpoint="head:29400", node_rank=1,
                               rdzv_conf="is_host=false", local_addr="10.0.0.2")):
        args = parse_args(torchrun_args(opts, ["cfg.yaml"]))
        assert args.nproc_per_node == str(opts.nproc_per_node)
    flag = any(a.startswith("--shutdown-timeout") for a in torchrun_args(LaunchOptions(), []))
    assert flag == agent_takes_shutdown_timeout() == (torch_version() >= (2, 13))


AGENT = """
import sys
from kubetrain.torch_compat import elastic_agent
from torch.distributed.run import parse_args, run
from kubetrain.launch.elastic import LaunchOptions, torchrun_args
args = torchrun_args(LaunchOptions(nproc_per_node=1, shutdown_timeout=int(sys.argv[1]), max_restarts=0), [])
args = args[: args.index("--module")] + [sys.argv[2], sys.argv[3]]
with elastic_agent({2, 75}, int(sys.argv[1])):
    run(parse_args(args))
"""

STUBBORN_WORKER = """
import signal, sys, time
from pathlib import Path
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a save that takes longer than any grace
Path(sys.argv[1]).write_text("up")
time.sleep(600)
"""


@pytest.mark.compat
@pytest.mark.slow
def test_the_agent_gives_workers_our_shutdown_timeout_not_torchs(tmp_path: Path) -> None:
    """The agent waits `shutdown_timeout` after SIGTERM, then kills: 3 s here, where torch <= 2.12 waits 30 s."""
    worker, ready = tmp_path / "worker.py", tmp_path / "ready"
    worker.write_text(STUBBORN_WORKER)
    agent = subprocess.Popen([sys.executable, "-c", AGENT, "3", str(worker), str(ready)], env=cli_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(ready.exists, agent)
        stopped = time.monotonic()
        agent.send_signal(signal.SIGTERM)
        _, err = agent.communicate(timeout=120)
        waited = time.monotonic() - stopped
    finally:
        agent.kill()
    assert agent.returncode != 0
    # 3 s of grace plus start-up of nothing: far below torch's fixed 30 s (a bound, not a timing: 3 s vs 30 s)
    assert waited < 20, (waited, err[-2000:])


REPORTING_AGENT = """
import sys
from kubetrain.launch.watch import wait_status, describe_exit
from kubetrain.torch_compat import elastic_agent
from torch.distributed.run import parse_args, run
from kubetrain.launch.elastic import LaunchOptions, torchrun_args
args = torchrun_args(LaunchOptions(nproc_per_node=1, max_restarts=1), [])
args = args[: args.index("--module")] + [sys.argv[1], sys.argv[2]]
def reaped(failures):
    for rank, f in failures.items():
        print("reaped", rank, f.pid, describe_exit(wait_status(f.exitcode)), flush=True)
try:
    with elastic_agent({2, 75}, 5, reaped):
        run(parse_args(args))
except Exception as e:
    print("gave up", type(e).__name__, flush=True)
"""

SELF_KILLING_WORKER = """
import os, signal, sys
with open(sys.argv[1], "a") as f:
    f.write(f"{os.getpid()}\\n")
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.compat
@pytest.mark.slow
def test_the_agent_says_how_each_worker_it_reaped_ended_before_it_restarts(tmp_path: Path) -> None:
    """The watch learns a reaped worker's status from the agent (a look after the agent's said "status unknown")."""
    worker, pids = tmp_path / "worker.py", tmp_path / "pids"
    worker.write_text(SELF_KILLING_WORKER)
    out = subprocess.run([sys.executable, "-c", REPORTING_AGENT, str(worker), str(pids)], env=cli_env(),
                         capture_output=True, text=True, timeout=300).stdout
    started = pids.read_text().split()
    assert len(started) == 2  # the first round and its one restart
    assert [line for line in out.splitlines() if line.startswith("reaped")] == [
        f"reaped 0 {pid} killed by SIGKILL" for pid in started]
    assert "gave up ChildFailedError" in out


@pytest.mark.compat
@pytest.mark.slow
def test_one_process_trains_generates_and_exports(tmp_path: Path) -> None:
    kubetrain("train", *sets("run.name=one", "train.max_steps=4", "eval.every_steps=4", "checkpoint.every_steps=4"),
              cwd=tmp_path)
    run = tmp_path / "runs" / "one"
    out = kubetrain("generate", str(run), "--prompt", "And God said", "--max-new-tokens", "8", cwd=tmp_path).stdout
    assert out.startswith("And God said")
    kubetrain("export", str(run), "--format", "hf", "-o", str(tmp_path / "hf"), cwd=tmp_path)
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    kubetrain("export", str(run), "--format", "gguf", "-o", str(tmp_path / "gguf" / "tiny.gguf"), cwd=tmp_path)
    assert (tmp_path / "gguf" / "tiny.gguf").stat().st_size > 0


@pytest.mark.compat
@pytest.mark.slow
def test_ddp_on_two_processes_finishes(tmp_path: Path) -> None:
    kubetrain("train", *sets("run.name=ddp", "train.max_steps=4", "eval.every_steps=4", "checkpoint.every_steps=2"),
              "--nproc", "2", cwd=tmp_path)
    meta = json.loads((tmp_path / "runs" / "ddp" / "meta.json").read_text())
    assert (meta["status"], meta["step"], meta["world_size"]) == ("finished", 4, 2)


@pytest.mark.compat
@pytest.mark.slow
def test_fsdp_with_background_saves_stops_on_sigterm_and_resumes(tmp_path: Path) -> None:
    common = ("run.name=fsdp", "dist.strategy=fsdp", "checkpoint.async_save=true", "checkpoint.every_steps=2",
              "eval.every_steps=1000")
    proc = start("train", *sets(*common, "train.max_steps=100000"), "--nproc", "2", cwd=tmp_path)
    run = tmp_path / "runs" / "fsdp"
    wait_until(lambda: (run / "checkpoints" / "latest").exists() and lines_in(run / "metrics.jsonl") >= 5, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 75, err[-3000:]
    stopped = json.loads((run / "meta.json").read_text())
    assert stopped["status"] == "stopped"
    step = stopped["step"]
    done = kubetrain("train", *sets(*common, f"train.max_steps={step + 2}"), "--nproc", "2", cwd=tmp_path)
    said = done.stdout + done.stderr
    assert "resuming from" in said and f"step-{step:06d} (step {step}," in said, said[-3000:]
    meta = json.loads((run / "meta.json").read_text())
    assert (meta["status"], meta["step"]) == ("finished", step + 2)


@pytest.mark.compat
@pytest.mark.slow
def test_two_launchers_meet_as_two_nodes(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{_free_port()}"
    args = ["train", *sets("run.name=nodes", "train.max_steps=3", "eval.every_steps=3"), "--nnodes", "2",
            "--nproc", "1", "--rdzv-endpoint", endpoint, "--rdzv-id", "compat"]
    nodes = [start(*args, "--node-rank", str(rank), cwd=tmp_path) for rank in (0, 1)]
    for node in nodes:
        _, err = node.communicate(timeout=300)
        assert node.returncode == 0, err[-3000:]
    assert json.loads((tmp_path / "runs" / "nodes" / "meta.json").read_text())["world_size"] == 2


@pytest.mark.compat
@pytest.mark.slow
def test_a_two_pod_simulated_job_finishes(tmp_path: Path) -> None:
    items = ["run.threads=1", "run.device=cpu", "model.n_layer=1", "model.n_head=2", "model.n_embd=32",
             "model.block_size=32", "train.micro_batch_size=4", "train.max_steps=4", "checkpoint.every_steps=2",
             "eval.windows=1", "eval.sample_prompt=null", "k8s.nnodes=2"]
    done = subprocess.run([sys.executable, "-m", "kubetrain", "k8s", "simulate", "--root", str(tmp_path / "sim"),
                           *[a for item in items for a in ("--set", item)], "--timeout", "300"],
                          env=cli_env(), capture_output=True, text=True, check=False, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    meta = json.loads((tmp_path / "sim" / "volumes" / "checkpoints" / "tiny" / "meta.json").read_text())
    assert (meta["status"], meta["step"], meta["world_size"]) == ("finished", 4, 2)


@pytest.mark.compat
@pytest.mark.slow
def test_lora_on_a_tiny_llama_trains_and_exports_merged(tmp_path: Path, make_lora_config, llama_dir: Path,
                                                       chat_file: Path) -> None:
    from kubetrain.config.loading import to_yaml

    cfg = make_lora_config(tmp_path / "runs", llama_dir, chat_file, train__max_steps=4, eval__every_steps=4,
                           checkpoint__every_steps=4)
    (tmp_path / "lora.yaml").write_text(to_yaml(cfg))
    kubetrain("train", str(tmp_path / "lora.yaml"), cwd=tmp_path)
    run = tmp_path / "runs" / "lora"
    assert yaml.safe_load((run / "config.yaml").read_text())["model"]["lora"]["r"] == 8
    kubetrain("export", str(run), "--format", "hf", "--merge", "-o", str(tmp_path / "merged"), cwd=tmp_path)
    assert (tmp_path / "merged" / "config.json").is_file()


def test_releasing_destroyed_groups_touches_no_deprecated_torch_name() -> None:
    # Every --nproc run ended with 8 FutureWarning lines ("torch.distributed.reduce_op is deprecated") from the scan
    # for DeviceMeshes at teardown: isinstance through torch 2.13's OpaqueBaseMeta touched reduce_op
    import warnings

    import torch.distributed.device_mesh  # noqa: F401  the scan looks only once DeviceMesh exists

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        release_destroyed_groups()
    assert [str(w.message) for w in caught] == []

"""Real multi-process training on gloo through torch.distributed.run: equivalence, two nodes, restarts, SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from safetensors.torch import load_file

from kubetrain import runs
from kubetrain.errors import EXIT_FAILURE, EXIT_STOPPED_RESUMABLE, UserInputError
from kubetrain.k8s.cluster.status import last_incident
from kubetrain.launch.elastic import (
    FINAL_EXIT_CODES,
    SHARE_STORE_OFF_ENV,
    LaunchOptions,
    _agent_extended,
    _stopped_by_signal,
    flight_recorder_env,
    launch,
    root_failure,
    store_per_round,
    torchrun_args,
)
from kubetrain.runs.incidents import read_all
from kubetrain.torch_compat import elastic_agent, torch_version
from kubetrain.train.heartbeat import HEARTBEAT_DIR_ENV, LAUNCHER_PID_ENV, round_identity
from tests.conftest import cli_env
from tests.train.conftest import kubetrain, lines_in, rank_of, sets, start, wait_until


def test_torchrun_command_lines() -> None:
    single = torchrun_args(LaunchOptions(nproc_per_node=2), ["cfg.yaml"])
    assert "--standalone" in single and single[-4:] == ["--module", "kubetrain", "train", "cfg.yaml"]
    multi = torchrun_args(LaunchOptions(nproc_per_node=8, nnodes="2:4", rdzv_endpoint="head:29400", rdzv_id="j",
                                        max_restarts=3), [])
    assert {"--nnodes=2:4", "--rdzv-backend=c10d", "--rdzv-endpoint=head:29400", "--rdzv-id=j",
            "--max-restarts=3", "--nproc-per-node=8"} <= set(multi)
    for bad, message in ((LaunchOptions(nnodes="2"), "--rdzv-endpoint"), (LaunchOptions(nnodes="3:2"), "MIN <= MAX"),
                         (LaunchOptions(nnodes="x"), "N or MIN:MAX"),
                         (LaunchOptions(nnodes="2", rdzv_endpoint="nohost"), "HOST:PORT")):
        with pytest.raises(UserInputError, match=message):
            torchrun_args(bad, [])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _train_losses(run: Path) -> list[float]:
    records = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    return [r["loss"] for r in records if r["kind"] == "train"]


def _weights(run: Path, step: int) -> dict:
    return load_file(run / "checkpoints" / f"step-{step:06d}" / "model.safetensors")


@pytest.mark.slow
@pytest.mark.ci  # a heavy end-to-end proof (many processes): .ci/run runs it, not the README's test command
def test_two_processes_match_one_process_with_the_same_global_batch(tmp_path: Path) -> None:
    common = ("train.max_steps=8", "eval.every_steps=100", "checkpoint.every_steps=100", f"data.cache_dir={tmp_path}/c")
    kubetrain("train", *sets("run.name=one", "train.grad_accum_steps=2", *common), cwd=tmp_path)
    kubetrain("train", *sets("run.name=two", *common), "--nproc", "2", cwd=tmp_path)
    one, two = _train_losses(tmp_path / "runs" / "one"), _train_losses(tmp_path / "runs" / "two")
    assert len(one) == len(two) == 8
    assert one[-1] < one[0]
    assert two == pytest.approx(one, rel=1e-4, abs=1e-5)
    meta = json.loads((tmp_path / "runs" / "two" / "meta.json").read_text())
    assert meta["world_size"] == 2
    # only rank 0 writes run files: one train record per step, not one per rank
    records = map(json.loads, (tmp_path / "runs" / "two" / "metrics.jsonl").read_text().splitlines())
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, 9))


@pytest.mark.slow
def test_two_launchers_rendezvous_over_loopback_as_two_nodes(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{_free_port()}"
    args = ["train", *sets("run.name=nodes", "train.max_steps=4", "eval.every_steps=2"), "--nnodes", "2",
            "--nproc", "1", "--rdzv-endpoint", endpoint, "--rdzv-id", "two-nodes", "--json"]
    node0 = start(*args, "--node-rank", "0", cwd=tmp_path)
    node1 = start(*args, "--node-rank", "1", cwd=tmp_path)
    out0, err0 = node0.communicate(timeout=300)
    out1, err1 = node1.communicate(timeout=300)
    assert node0.returncode == 0 and node1.returncode == 0, err0 + err1
    results = [json.loads(line) for out in (out0, out1) for line in out.splitlines() if line.startswith('{"run_dir"')]
    assert len(results) == 1 and results[0]["steps"] == 4  # one report, from global rank 0
    assert json.loads((tmp_path / "runs" / "nodes" / "meta.json").read_text())["world_size"] == 2


def _workers(launcher_pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == launcher_pid and b"kubetrain" in cmd:
            found.append(int(entry.name))
    return found


@pytest.mark.slow
@pytest.mark.ci  # a heavy end-to-end proof (many processes): .ci/run runs it, not the README's test command
def test_killed_worker_is_restarted_and_the_run_ends_like_an_uninterrupted_one(tmp_path: Path) -> None:
    common = ("train.max_steps=30", "eval.every_steps=10", "checkpoint.every_steps=5", "model.n_embd=64",
              f"data.cache_dir={tmp_path}/c")
    kubetrain("train", *sets("run.name=ref", *common), "--nproc", "2", cwd=tmp_path)
    proc = start("train", *sets("run.name=elastic", *common), "--nproc", "2", "--max-restarts", "2",
                 cwd=tmp_path)
    latest = tmp_path / "runs" / "elastic" / "checkpoints" / "latest"
    wait_until(latest.exists, proc)
    workers = _workers(proc.pid)
    assert len(workers) == 2
    os.kill(next(pid for pid in workers if rank_of(pid) == 1), signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "resuming from" in out
    # the killed rank is the incident, not rank 0 that lost its peer
    [exit] = read_all(tmp_path / "runs" / "elastic")
    assert (exit["kind"], exit["rank"], exit["message"]) == ("worker-exit", 1, "killed by SIGKILL"), exit
    mine, ref = _weights(tmp_path / "runs" / "elastic", 30), _weights(tmp_path / "runs" / "ref", 30)
    assert all(mine[k].equal(ref[k]) for k in ref)
    assert _train_losses(tmp_path / "runs" / "elastic") == _train_losses(tmp_path / "runs" / "ref")


@pytest.mark.slow
def test_failed_worker_without_restarts_fails_the_job_fast_with_its_error(tmp_path: Path) -> None:
    proc = start("train", *sets("run.name=dies", "train.max_steps=10000", "checkpoint.every_steps=5"),
                 "--nproc", "2", "--max-restarts", "0", cwd=tmp_path)
    latest = tmp_path / "runs" / "dies" / "checkpoints" / "latest"
    wait_until(latest.exists, proc)
    os.kill(max(_workers(proc.pid)), signal.SIGKILL)
    _, err = proc.communicate(timeout=120)  # no hang: the agent tears the job down
    assert proc.returncode == 1
    assert "error: rank" in err and "Signal 9" in err, err[-3000:]
    # the surviving rank lost its peer: one line (when it got that far before the agent stopped it), no traceback
    assert "Traceback" not in err and "[rank0]:" not in err, err[-3000:]


@pytest.mark.slow
def test_sigterm_to_the_launcher_saves_and_exits_resumable(tmp_path: Path) -> None:
    proc = start("train", *sets("run.name=term", "train.max_steps=10000", "checkpoint.every_steps=10000"),
                 "--nproc", "2", cwd=tmp_path)
    metrics = tmp_path / "runs" / "term" / "metrics.jsonl"
    wait_until(lambda: lines_in(metrics) >= 3, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_STOPPED_RESUMABLE, err
    meta = json.loads((tmp_path / "runs" / "term" / "meta.json").read_text())
    assert meta["status"] == "stopped"
    assert [e["kind"] for e in meta["incidents"]] == ["preempted"]
    incident = last_incident({"launcher": err.splitlines()})  # the line `k8s status` finds in a pod's log
    assert incident is not None and (incident["kind"], incident["rank"]) == ("preempted", None)
    assert incident["step"] == meta["incidents"][0]["step"] and "SIGTERM to the launcher" in incident["message"]
    step = meta["step"]
    assert (tmp_path / "runs" / "term" / "checkpoints" / f"step-{step:06d}" / "meta.json").is_file()


def _listening(endpoint: str) -> bool:
    host, port = endpoint.split(":")
    with socket.socket() as s:
        return s.connect_ex((host, int(port))) == 0


@pytest.mark.slow
def test_sigterm_while_waiting_in_the_rendezvous_exits_resumable_with_its_line(tmp_path: Path) -> None:
    # A pod stopped while the other nodes are not up yet: nothing is lost, so 75 and the line (it was 143, silent).
    endpoint = f"127.0.0.1:{_free_port()}"
    proc = start("train", *sets("run.name=early"), "--nnodes", "2", "--nproc", "1", "--rdzv-endpoint", endpoint,
                 "--node-rank", "0", cwd=tmp_path)
    wait_until(lambda: _listening(endpoint), proc)  # node 0 hosts the rendezvous store: it waits for node 1 there
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_STOPPED_RESUMABLE, err
    assert "SIGTERM: stopped before the first checkpoint" in err and "Traceback" not in err


@pytest.mark.slow
@pytest.mark.ci  # a heavy end-to-end proof (many processes): .ci/run runs it, not the README's test command
def test_resume_with_another_world_size_continues_the_data_without_replay(tmp_path: Path) -> None:
    common = ("train.max_steps=12", "eval.every_steps=100", "checkpoint.every_steps=100", "train.log_every_steps=1",
              f"data.cache_dir={tmp_path}/c")
    kubetrain("train", *sets("run.name=ref", *common), "--nproc", "2", cwd=tmp_path)
    proc = start("train", *sets("run.name=mixed", *common), "--nproc", "2", cwd=tmp_path)
    metrics = tmp_path / "runs" / "mixed" / "metrics.jsonl"
    wait_until(lambda: lines_in(metrics) >= 3, proc)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert proc.returncode == EXIT_STOPPED_RESUMABLE
    # the same global batch from one process: the loader's global cursor carries on where two ranks left off
    single = kubetrain("train", *sets("run.name=mixed", *common, "train.grad_accum_steps=2"), cwd=tmp_path)
    assert "RNG states of 2 ranks" in single.stdout
    ref, mixed = _train_losses(tmp_path / "runs" / "ref"), _train_losses(tmp_path / "runs" / "mixed")
    assert len(mixed) == 12
    assert mixed == pytest.approx(ref, rel=1e-4, abs=1e-5)


@dataclass
class Failure:  # the fields of torch's ProcessFailure that the choice reads
    message: str
    timestamp: int
    exitcode: int = 1


def test_the_root_failure_is_the_killed_worker_not_the_peer_that_lost_it() -> None:
    gloo = ("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:3477. This is typically "
            "caused by a remote worker crashing.")
    killed = "Signal 9 (SIGKILL) received by PID 27355"
    # whole-second timestamps: torch's get_first_failure gives a tie to rank 0, the peer that lost its partner
    assert root_failure({0: Failure(gloo, 100), 1: Failure(killed, 100)}) == (1, Failure(killed, 100))
    assert root_failure({0: Failure(gloo, 99), 1: Failure(killed, 100)})[0] == 1
    # among causes, the earliest; with no cause at all, the earliest effect
    assert root_failure({0: Failure("ValueError: bad", 101), 1: Failure(killed, 100)})[0] == 1
    # rank 1 stopped on its own SIGTERM (75); the agent then stopped rank 0 with SIGTERM in the same second: seen
    # in test_a_worker_stopped_by_its_own_signal_is_not_restarted, which exited 1 ("rank 0 failed with exit code -15")
    stopped = Failure("stopped by SIGTERM at step 9", 100, EXIT_STOPPED_RESUMABLE)
    ended = Failure("Signal 15 (SIGTERM) received by PID 3106", 100, -signal.SIGTERM)
    assert root_failure({0: ended, 1: stopped}) == (1, stopped)
    assert root_failure({0: Failure(gloo, 101), 1: Failure(gloo, 100)})[0] == 1


def test_flight_recorder_names_follow_the_torch_that_runs_the_workers(tmp_path: Path) -> None:
    prefix = str((tmp_path / "incidents" / "nccl_trace_rank_").resolve())
    env: dict[str, str] = {}
    flight_recorder_env(tmp_path, env, torch_version=(2, 13))
    assert env == {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_DUMP_TEMP_FILE": prefix}
    assert (tmp_path / "incidents").is_dir()
    old: dict[str, str] = {}
    flight_recorder_env(tmp_path, old, torch_version=(2, 4))
    assert old == {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                   "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix}
    # a pod spec (rendered elsewhere) or k8s.env set the other name: its value is kept, under the name torch reads
    pod = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "20000", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/ckpt/r/incidents/x-",
           "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    flight_recorder_env(tmp_path, pod, torch_version=(2, 15))
    assert pod == {"TORCH_FR_BUFFER_SIZE": "20000", "TORCH_FR_DUMP_TEMP_FILE": "/ckpt/r/incidents/x-",
                   "TORCH_FR_DUMP_ON_TIMEOUT": "1"}
    both = {"TORCH_FR_BUFFER_SIZE": "10", "TORCH_NCCL_TRACE_BUFFER_SIZE": "20"}
    flight_recorder_env(tmp_path, both, torch_version=(2, 13))
    assert both["TORCH_FR_BUFFER_SIZE"] == "10" and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in both  # the one read wins


GROUP = """
import sys, torch, torch.distributed as td
td.init_process_group("gloo", rank=0, world_size=1, init_method="file://" + sys.argv[1])
t = torch.ones(1)
td.all_reduce(t)
td.destroy_process_group()
"""


@pytest.mark.slow
def test_the_launchers_flight_recorder_names_draw_no_deprecation_warning(tmp_path: Path) -> None:
    def group_stderr(extra: dict[str, str], store: str) -> str:
        env = {k: v for k, v in cli_env().items() if not k.startswith(("TORCH_FR_", "TORCH_NCCL_"))}
        done = subprocess.run([sys.executable, "-c", GROUP, str(tmp_path / store)], env={**env, **extra},
                              capture_output=True, text=True, timeout=120, check=True)
        return done.stderr

    launcher: dict[str, str] = {}
    flight_recorder_env(tmp_path, launcher)  # the installed torch decides
    assert "deprecated" not in group_stderr(launcher, "a"), launcher
    if torch_version() >= (2, 13):  # seen there: the old name is read even under gloo, and warned about
        assert "TORCH_NCCL_TRACE_BUFFER_SIZE is deprecated" in group_stderr(
            {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"}, "b")


@pytest.mark.slow
def test_a_worker_with_bad_input_ends_the_group_at_once_with_its_line(tmp_path: Path) -> None:
    # found only inside the workers (the launcher checked the config and that the path exists): the folder to resume
    # holds no checkpoint
    (tmp_path / "nope").mkdir()
    done = kubetrain("train", *sets("run.name=bad"), "--nproc", "2", "--resume", "nope",
                     cwd=tmp_path, check=False)  # --max-restarts left at its default (3)
    assert done.returncode == 2, done.stderr[-3000:]
    starts = sum("process 0/2" in line for line in done.stdout.splitlines())
    assert starts == 1, done.stdout[-3000:]  # rank 0 started once: the group was not restarted
    assert done.stderr.rstrip().splitlines()[-1] == (
        "error: no usable checkpoint at nope"), done.stderr[-3000:]
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_a_worker_stopped_by_its_own_signal_is_not_restarted(tmp_path: Path) -> None:
    proc = start("train", *sets("run.name=stopped", "train.max_steps=10000", "checkpoint.every_steps=5"),
                 "--nproc", "2", cwd=tmp_path)  # --max-restarts left at its default (3)
    wait_until((tmp_path / "runs" / "stopped" / "checkpoints" / "latest").exists, proc)
    os.kill(min(_workers(proc.pid)), signal.SIGTERM)  # one worker only: the stop vote stops both
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_STOPPED_RESUMABLE, err[-3000:]
    assert sum("process 0/2" in line for line in out.splitlines()) == 1, out[-3000:]  # not restarted
    meta = json.loads((tmp_path / "runs" / "stopped" / "meta.json").read_text())
    assert meta["status"] == "stopped"


def _gone_pid() -> int:
    """The pid of a process that has ended (what meta.json holds after rank 0 was killed)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize(("recorded", "checkpoint", "expected", "said"), [
    ("stopped", "step-000010", EXIT_STOPPED_RESUMABLE, "workers stopped (run status: stopped)"),
    ("running", "step-000010", EXIT_STOPPED_RESUMABLE, "the run resumes from step-000010"),  # rank 0 killed
    ("running", None, EXIT_STOPPED_RESUMABLE, "nothing to lose"),
    ("failed", "step-000010", EXIT_FAILURE, "the run had failed"),  # not 75: a restart would redo the failure
    ("failed", None, EXIT_FAILURE, "the run had failed"),
])
def test_the_launchers_exit_after_a_signal_says_whether_the_run_failed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], recorded: str, checkpoint: str | None, expected: int,
        said: str) -> None:
    """75 only when nothing is lost and nothing failed; a run that had failed and is then stopped exits 1, so the
    Job's backoffLimit counts it."""
    run = tmp_path / "run"
    run.mkdir()
    runs.update_meta(run, status=recorded, host=socket.gethostname(), pid=_gone_pid(), step=10)
    if checkpoint:
        (run / runs.CHECKPOINTS).mkdir()
        (run / runs.CHECKPOINTS / "latest").write_text(checkpoint)
    assert _stopped_by_signal(signal.SIGTERM, run, 10) == expected
    err = capsys.readouterr().err
    assert said in err and "incident: preempted" in err, err
    [preempted] = read_all(run)
    assert (preempted["kind"], preempted["step"]) == ("preempted", 10)


def test_a_failed_phase_of_a_run_of_phases_is_a_failure_when_stopped(tmp_path: Path) -> None:
    run = tmp_path / "run"
    runs.record_phases(run, ["pretrain", "code"], "running", "code")
    (run / runs.PHASES / "code").mkdir(parents=True)
    runs.update_meta(run / runs.PHASES / "code", status="failed", step=3)
    assert _stopped_by_signal(signal.SIGINT, run, 3) == EXIT_FAILURE


def test_the_watch_learns_whether_the_agent_reports_every_failed_round() -> None:
    """Only under our agent may the watch take a worker reaped without a report for one the agent stopped."""
    assert not _agent_extended()
    with elastic_agent(FINAL_EXIT_CODES, 30, lambda failures: None):
        assert _agent_extended()
    assert not _agent_extended()


def test_a_stop_before_the_first_checkpoint_is_recorded_in_words(tmp_path: Path) -> None:
    """The preempted incident of a run that had saved nothing says so, not `latest checkpoint None`."""
    run_dir = tmp_path / "run"
    assert _stopped_by_signal(signal.SIGTERM, run_dir, None) == EXIT_STOPPED_RESUMABLE
    [incident] = read_all(run_dir)
    assert "None" not in incident["message"] and "unknown" not in incident["message"]
    assert "no checkpoint yet (the run starts over)" in incident["message"]


@pytest.mark.parametrize("preset", ["0", "true", None])
def test_every_rendezvous_round_has_a_round_key_of_its_own_whatever_the_environment_presets(
        preset: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hang watch tells rounds apart by the workers' store address (heartbeat.round_identity). torch gives the
    workers a new store each round only when TORCH_DISABLE_SHARE_RDZV_TCP_STORE is exactly "1"; with any other
    value they share the agent's, and every round would have the first round's key: a later hang would look like
    one already handled. Two real rounds of torch's c10d rendezvous, on the store it hosts."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    if preset is None:
        monkeypatch.delenv(SHARE_STORE_OFF_ENV, raising=False)
    else:
        monkeypatch.setenv(SHARE_STORE_OFF_ENV, preset)
    said: list[str] = []
    store_per_round(os.environ, said.append)  # what the launcher does before its agent starts
    assert len(said) == (0 if preset is None else 1) and all(SHARE_STORE_OFF_ENV in line for line in said)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    handler = get_rendezvous_handler(RendezvousParameters(
        backend="c10d", endpoint=f"127.0.0.1:{port}", run_id="job", min_nodes=1, max_nodes=1, is_host=True,
        local_addr="127.0.0.1"))
    keys = []
    try:
        for _ in range(2):  # the first round, and the one after a restart
            store = handler.next_rendezvous().bootstrap_store_info  # the MASTER_ADDR/PORT the workers are given
            keys.append(round_identity({"MASTER_ADDR": store.master_addr, "MASTER_PORT": str(store.master_port),
                                        "TORCHELASTIC_RESTART_COUNT": "0"}))  # one node's count: not the round
    finally:
        handler.shutdown()
    assert keys[0] != keys[1]


@pytest.mark.slow
def test_the_callers_signal_handlers_are_back_after_a_launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher turns SIGTERM/SIGINT into an exception while it waits in the rendezvous, and torch's agent
    installs its own: a program that launches (a test, a notebook, a pod's entrypoint doing more afterwards) gets its
    own handlers back, not one that raises an exception of a launch long over."""
    for name in (SHARE_STORE_OFF_ENV, "OMP_NUM_THREADS", HEARTBEAT_DIR_ENV, LAUNCHER_PID_ENV):  # launch sets these
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PYTHONPATH", cli_env()["PYTHONPATH"])
    monkeypatch.chdir(tmp_path)
    (tmp_path / "nope").mkdir()

    def own_term(signum: int, frame: object) -> None: ...

    def own_int(signum: int, frame: object) -> None: ...

    before = signal.signal(signal.SIGTERM, own_term), signal.signal(signal.SIGINT, own_int)
    try:
        # the worker finds no checkpoint to resume from: exit 2 at once, the quickest whole launch there is
        code = launch(LaunchOptions(max_restarts=0), [*sets("run.name=bad"), "--resume", "nope"],
                      tmp_path / "runs" / "bad")
        assert code == 2
        assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == (own_term, own_int)
    finally:
        signal.signal(signal.SIGTERM, before[0])
        signal.signal(signal.SIGINT, before[1])

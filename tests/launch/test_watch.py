"""The launcher's hang watch: real processes (one stopped with SIGSTOP), real heartbeat files, real stacks."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kubetrain.k8s.cluster.status import last_incident
from kubetrain.launch.watch import Beat, HangWatch, describe_exit, process_state, wait_status
from kubetrain.runs.incidents import parse_log_line, read_all
from kubetrain.track.console import parse_progress
from kubetrain.train.heartbeat import HEARTBEAT_DIR_ENV, Heartbeat, beat_file
from tests.train.conftest import STARTED, children, kubetrain, lines_in, rank_of, sets, start, wait_until

# A worker stand-in: the real Heartbeat (faulthandler on SIGUSR1), one beat, then a wait in a named function.
WORKER = """
import os, sys, time
from pathlib import Path
from kubetrain.train.heartbeat import Heartbeat
beat = Heartbeat(Path(sys.argv[1]), int(sys.argv[2]))
beat.beat(int(sys.argv[3]))
def waiting_in_a_collective():
    while True:
        time.sleep(0.05)
print("ready", flush=True)
waiting_in_a_collective()
"""


def _worker(folder: Path, rank: int, step: int, **agent_env: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **agent_env}
    proc = subprocess.Popen([sys.executable, "-c", WORKER, str(folder), str(rank), str(step)],
                            stdout=subprocess.PIPE, text=True, env=env)
    STARTED.append(proc)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


def test_a_hang_dumps_the_stacks_of_the_ranks_that_answer_names_the_stopped_one_and_ends_them(tmp_path: Path) -> None:
    beats, run = tmp_path / "beats", tmp_path / "run"
    beats.mkdir()
    workers = [_worker(beats, 0, 7), _worker(beats, 1, 6)]
    os.kill(workers[1].pid, signal.SIGSTOP)
    while process_state(workers[1].pid)[0] != "T":  # delivered a moment later
        time.sleep(0.01)
    said: list[str] = []
    watch = HangWatch(beats, run, hang_timeout=30.0, say=said.append)
    watch.check(now=time.time())  # fresh beats: nothing happens
    assert not read_all(run) and all(w.poll() is None for w in workers)
    watch.check(now=time.time() + 60)
    for w in workers:
        assert w.wait(timeout=30) == -signal.SIGKILL
    [hang] = read_all(run)
    [line] = said  # one line per incident, the one `k8s status` reads from a pod's log
    assert parse_log_line(line) == {**{k: hang[k] for k in ("kind", "rank", "step")}, "time": int(hang["time"]),
                                    "message": f"{hang['message']}; stacks in {run / hang['stacks']}"}
    assert hang["kind"] == "hang" and hang["rank"] == 1 and hang["step"] == 6
    assert "did not answer" in hang["message"]
    stacks = (run / hang["stacks"]).read_text()
    assert "suspect: rank 1" in stacks
    rank0, rank1 = stacks.split("=== rank 1")
    assert "waiting_in_a_collective" in rank0  # faulthandler's dump from the rank that answered
    assert "no stacks: it is stopped" in rank1
    watch.check(now=time.time() + 120)  # the same round is not handled twice
    assert len(read_all(run)) == 1


@pytest.mark.parametrize("seen", ["zombie", "reaped"])
def test_a_round_after_a_membership_change_is_watched_and_the_agents_stop_is_no_incident(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seen: str) -> None:
    """The node that did not fail: a peer on another node was killed, so this node's agent stopped its
    rank 0 with SIGTERM and restarted for the new membership. Its restart count stays 0, and the rendezvous gave it
    rank 1 this time. The stop is no incident (the killed peer's node records that), and a hang of the new round is
    still found: the watch told rounds apart by the restart count, so it saw the new round as handled, and stayed
    blind while its frozen rank hung the job."""
    beats, run = tmp_path / "beats", tmp_path / "run"
    beats.mkdir()
    said: list[str] = []
    # an agent that reports every failed round (ours): one it reaped without a word stopped the worker itself
    watch = HangWatch(beats, run, hang_timeout=30.0, say=said.append, agent_reports=True)
    monkeypatch.setattr("kubetrain.launch.watch.REAPED_WAIT_SECONDS", 0.0)
    first = _worker(beats, 0, 5, MASTER_ADDR="10.0.0.7", MASTER_PORT="41000", TORCHELASTIC_RESTART_COUNT="0")
    watch.check()
    first.terminate()  # the agent's stop of its group; the worker stays a zombie with its status until reaped
    while process_state(first.pid)[0] != "Z":
        time.sleep(0.01)
    if seen == "reaped":  # the agent's close() reaped it before the watch looked: no status to read
        first.wait()
    watch.check()
    first.wait()
    assert not read_all(run), "the agent's stop of a healthy worker is not an incident"
    assert said and ("killed by SIGTERM: its agent ended the round" if seen == "zombie"
                     else "ended by its agent without a failure") in said[-1], said
    second = _worker(beats, 1, 3, MASTER_ADDR="10.0.0.7", MASTER_PORT="42000", TORCHELASTIC_RESTART_COUNT="0")
    os.kill(second.pid, signal.SIGSTOP)
    while process_state(second.pid)[0] != "T":
        time.sleep(0.01)
    watch.check(now=time.time() + 60)
    assert second.wait(timeout=30) == -signal.SIGKILL
    [hang] = read_all(run)
    assert (hang["kind"], hang["rank"], hang["step"]) == ("hang", 1, 3) and "did not answer" in hang["message"]
    stacks = (run / hang["stacks"]).read_text()
    assert "suspect: rank 1" in stacks and "=== rank 0" not in stacks  # the gone round's file is not this round


def test_every_stacks_file_names_the_jobs_suspect(tmp_path: Path) -> None:
    """Node 0 holds only healthy rank 0 (it answered); the nodes agree that rank 1, on node 1, is stuck. Node 0's
    stacks file said `suspect: rank 0` (its own guess) while the job's suspect was rank 1."""
    beats, run = tmp_path / "beats", tmp_path / "run"
    beats.mkdir()
    worker = _worker(beats, 0, 7)
    said: list[str] = []
    watch = HangWatch(beats, run, hang_timeout=30.0, say=said.append)
    watch.agree = lambda restart, verdict: {"rank": 1, "step": 6, "silent": True}
    watch.check(now=time.time() + 60)
    assert worker.wait(timeout=30) == -signal.SIGKILL
    [stacks] = (run / "incidents").glob("*-hang-stacks.txt")
    assert stacks.read_text().splitlines()[0] == "hang: no rank advanced for 60s; suspect: rank 1 (on another node)"
    assert not read_all(run) and "the stuck rank is rank 1 on another node" in said[0]


def test_a_node_slower_than_the_stuck_ranks_names_the_suspect_the_others_agreed_on(tmp_path: Path) -> None:
    """CI, two pods: the stuck rank's node ended the hang before the healthy node's (loaded) watch declared it, so
    the healthy node saw only its rank stopped by its agent and said "a peer failed or left", never which rank hung.
    It reads the verdict the stuck node published in the rendezvous host's store (a real TCPStore) instead."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from kubetrain.launch.hang_agreement import HangAgreement

    host = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    endpoint = f"127.0.0.1:{host.port}"
    beats, run = tmp_path / "beats", tmp_path / "run"
    beats.mkdir()
    said: list[str] = []
    healthy = HangAgreement(endpoint, "job", nodes=2)
    watch = HangWatch(beats, run, hang_timeout=30.0, say=said.append, published=healthy.published)
    worker = _worker(beats, 0, 5, MASTER_ADDR="10.0.0.7", MASTER_PORT="43000", TORCHELASTIC_RESTART_COUNT="0")
    round_key = watch.beats()[0].round_key
    assert healthy.published(round_key) is None  # no hang declared anywhere yet
    stuck_node = HangAgreement(endpoint, "job", nodes=2, wait=0.2)  # the other node: it declares the hang alone
    chosen = stuck_node.agree(round_key, {"rank": 1, "step": 4, "silent": True})
    assert chosen == {"rank": 1, "step": 4, "silent": True}
    worker.terminate()  # this node's agent stops its rank when the peer is killed
    while process_state(worker.pid)[0] != "Z":
        time.sleep(0.01)
    watch.check()
    worker.wait()
    assert not read_all(run), "the stuck node records the hang, not this one"
    assert said == ["launcher: hang: the stuck rank is rank 1 on another node (its launcher records the incident); "
                    "rank 0 of this node lost its peer"], said


def test_a_worker_that_dies_on_its_own_is_recorded_once_with_its_rank_and_step(tmp_path: Path) -> None:
    beats, run = tmp_path / "beats", tmp_path / "run"
    beats.mkdir()
    worker = _worker(beats, 3, 11)
    proc = subprocess.Popen(["sleep", "60"])  # our child: it stays a zombie (with its status) until reaped
    record = json.loads(beat_file(beats, 3).read_text())
    beat_file(beats, 3).write_text(json.dumps({**record, "pid": proc.pid}))
    proc.kill()
    while process_state(proc.pid)[0] != "Z":
        time.sleep(0.01)
    said: list[str] = []
    watch = HangWatch(beats, run, hang_timeout=None, say=said.append)
    watch.check()
    watch.check()
    proc.wait()
    [entry] = read_all(run)
    assert entry["kind"] in ("worker-exit", "oom") and entry["rank"] == 3 and entry["step"] == 11
    assert "SIGKILL" in entry["message"]
    [line] = said
    assert line.startswith(f"incident: {entry['kind']} on rank 3 at step 11 (")
    assert line.endswith("): killed by SIGKILL")
    assert worker.poll() is None  # only the hang path ends workers


def test_a_worker_the_agent_reaped_first_is_recorded_with_the_status_the_agent_saw(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CI saw "exited (status unknown: already reaped)" for a SIGKILLed rank: the agent had polled it first."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    beats, run = tmp_path / "beats", tmp_path / "run"
    beats.mkdir()
    worker = _worker(beats, 1, 6)
    worker.kill()
    worker.wait()  # reaped, as the agent's poll does: no zombie, no status in /proc
    said: list[str] = []
    watch = HangWatch(beats, run, hang_timeout=None, say=said.append)
    watch.check()
    assert not read_all(run)  # the agent is about to say how it ended
    watch.agent_reaped({1: ProcessFailure(local_rank=1, pid=worker.pid, exitcode=-signal.SIGKILL, error_file="")})
    [entry] = read_all(run)
    assert (entry["kind"], entry["rank"], entry["step"]) in {("worker-exit", 1, 6), ("oom", 1, 6)}
    assert entry["message"] == "killed by SIGKILL"
    watch.check()
    assert len(read_all(run)) == 1 and len(said) == 1
    # an agent that never says (a torch whose agent kubetrain could not extend): recorded, unknown, after a wait
    monkeypatch.setattr("kubetrain.launch.watch.REAPED_WAIT_SECONDS", 0.0)
    later = HangWatch(beats, tmp_path / "later", hang_timeout=None, say=said.append)
    later.check()
    [entry] = read_all(tmp_path / "later")
    assert entry["message"] == "exited (status unknown: already reaped)"


@pytest.mark.parametrize(("said", "kind"), [
    ("[c10d] Timed out waiting 30000ms for recv operation to complete", "timeout"),
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "oom"),
    ("ValueError: bad batch", "worker-exit"),
])
def test_what_a_worker_wrote_before_it_died_decides_the_kind(tmp_path: Path, said: str, kind: str) -> None:
    error_file = tmp_path / "error.json"
    error_file.write_text(json.dumps({"message": {"message": said, "extraInfo": {}}}))  # torch's @record shape
    watch = HangWatch(tmp_path / "beats", tmp_path / "run", hang_timeout=None, say=lambda m: None)
    watch.record_exit(Beat(rank=1, pid=1, step=9, time=0.0, restart=0, error_file=str(error_file)), 1 << 8)
    [entry] = read_all(tmp_path / "run")
    assert (entry["kind"], entry["rank"], entry["step"]) == (kind, 1, 9) and entry["message"] == said


def test_exit_statuses_read_like_the_shell() -> None:
    assert describe_exit(9) == "killed by SIGKILL"
    assert describe_exit(1 << 8) == "exited with code 1"
    assert describe_exit(wait_status(-signal.SIGKILL)) == "killed by SIGKILL"  # how torch's agent reports them
    assert describe_exit(wait_status(3)) == "exited with code 3"
    assert "unknown" in describe_exit(None)


def test_no_heartbeat_without_a_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(HEARTBEAT_DIR_ENV, raising=False)
    assert Heartbeat.from_env(0) is None


@pytest.mark.slow
@pytest.mark.ci  # a heavy end-to-end proof (many processes): .ci/run runs it, not the README's test command
def test_a_stopped_worker_is_detected_dumped_restarted_and_the_run_completes(tmp_path: Path) -> None:
    # One setting scales every clock (config/clocks.py): the watch at 8 s acts before the collective timeout
    # (23 s), so the one incident names the stopped rank 1, not rank 0 that noticed.
    proc = start("train", *sets("run.name=hang", "train.max_steps=40", "checkpoint.every_steps=5",
                                "eval.every_steps=100", "dist.hang_timeout_seconds=8"),
                 "--nproc", "2", "--max-restarts", "1", cwd=tmp_path)
    run = tmp_path / "runs" / "hang"
    wait_until((run / "checkpoints" / "latest").exists, proc)
    workers = children(proc.pid)
    assert len(workers) == 2
    stopped_at = time.monotonic()
    os.kill(next(pid for pid in workers if rank_of(pid) == 1), signal.SIGSTOP)
    wait_until(lambda: bool(read_all(run)), proc, poll=0.05)
    print(f"SIGSTOP of rank 1 -> incident in {time.monotonic() - stopped_at:.1f}s")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "resuming from" in out
    [hang] = read_all(run)  # the only incident: no `timeout` of the rank that noticed
    assert (hang["kind"], hang["rank"]) == ("hang", 1), hang
    # what `k8s status` reads from a pod's log: the launcher's incident line, rank 0's last progress line
    incident = last_incident({"pod": err.splitlines()})
    assert incident is not None
    assert (incident["kind"], incident["rank"], incident["step"]) == ("hang", 1, hang["step"])
    assert incident["message"].startswith("no rank advanced for")
    progress = [p for line in out.splitlines() if (p := parse_progress(line)) is not None]
    assert (progress[-1]["step"], progress[-1]["max_steps"]) == (40, 40) and progress[-1]["slowest_rank"] in (0, 1)
    stacks = (run / hang["stacks"]).read_text()
    assert stacks.count("=== rank") == 2 and "no stacks: it is stopped" in stacks
    assert stacks.count("File ") >= 1  # rank 0 answered with its Python frames
    meta = json.loads((run / "meta.json").read_text())
    assert meta["status"] == "finished" and meta["step"] == 40
    assert [e["kind"] for e in meta["incidents"]] == ["hang"]
    shown = kubetrain("runs", "show", str(run), cwd=tmp_path).stdout
    assert "hang at step" in shown and "(rank 1)" in shown


@pytest.mark.slow
def test_workers_die_with_a_killed_launcher(tmp_path: Path) -> None:
    proc = start("train", *sets("run.name=orphan", "train.max_steps=100000", "checkpoint.every_steps=100000"),
                 "--nproc", "2", cwd=tmp_path)
    wait_until(lambda: (tmp_path / "runs" / "orphan" / "metrics.jsonl").exists(), proc)
    workers = children(proc.pid)
    assert len(workers) == 2
    proc.kill()
    proc.communicate()
    deadline = time.monotonic() + 60
    while any(process_state(pid)[0] not in ("X", "Z") for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    orphans = [pid for pid in workers if process_state(pid)[0] not in ("X", "Z")]
    for pid in orphans:
        os.kill(pid, signal.SIGKILL)
    assert not orphans


@pytest.mark.ci  # two launchers and a hang (25 s); the store's agreement is shown by the unit tests above (CI's stage)
@pytest.mark.slow
def test_two_nodes_agree_on_the_stuck_rank_through_the_rendezvous_store(tmp_path: Path) -> None:
    """Two launchers as two nodes; rank 1 (node 1's) SIGSTOPped. Node 0's watch sees only its healthy rank 0
    and would blame it ("advanced least"); through the rendezvous store both name rank 1, recorded once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{s.getsockname()[1]}"
    args = ["train", *sets("run.name=nodes", "train.max_steps=100000", "checkpoint.every_steps=100000",
                           "eval.every_steps=100000", "dist.hang_timeout_seconds=8"),
            "--nnodes", "2", "--nproc", "1", "--rdzv-endpoint", endpoint, "--rdzv-id", "agree",
            "--max-restarts", "0"]
    nodes = [start(*args, "--node-rank", str(n), cwd=tmp_path) for n in (0, 1)]
    run = tmp_path / "runs" / "nodes"
    wait_until(lambda: lines_in(run / "metrics.jsonl") >= 3, nodes[0])
    workers = [pid for node in nodes for pid in children(node.pid)]
    os.kill(next(pid for pid in workers if rank_of(pid) == 1), signal.SIGSTOP)
    errs = [node.communicate(timeout=300)[1] for node in nodes]
    assert [node.returncode for node in nodes] == [1, 1], errs
    [hang] = read_all(run)
    assert (hang["kind"], hang["rank"]) == ("hang", 1), hang
    assert "did not answer" in hang["message"]
    assert any("the stuck rank is rank 1 on another node" in err for err in errs), errs


def _beat_of(pid: int) -> Beat | None:
    """The heartbeat record of a running worker, read from the folder its launcher named in its environment."""
    try:
        env = dict(item.split(b"=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if item)
    except OSError:
        return None
    folder, rank = env.get(HEARTBEAT_DIR_ENV.encode()), rank_of(pid)
    return Beat.read(beat_file(Path(folder.decode()), rank)) if folder and rank is not None else None


@pytest.mark.ci  # a hang after a restart (30 s): test_liveness's pod shows it too (CI's stage)
@pytest.mark.slow
def test_a_rank_stopped_after_an_elastic_restart_is_named_with_its_stacks(tmp_path: Path) -> None:
    """Kill rank 1, let the agent restart the group and resume, then SIGSTOP the new rank 0. The watch must
    name rank 0 (the new round's processes and beats), and a SIGKILL is one incident, not one per rank."""
    proc = start("train", *sets("run.name=again", "train.max_steps=100000", "checkpoint.every_steps=5",
                                "eval.every_steps=100000", "dist.hang_timeout_seconds=8"),
                 "--nproc", "2", "--max-restarts", "1", cwd=tmp_path)
    run = tmp_path / "runs" / "again"
    wait_until((run / "checkpoints" / "latest").exists, proc)
    first = children(proc.pid)
    os.kill(next(pid for pid in first if rank_of(pid) == 1), signal.SIGKILL)

    def resumed_rank0() -> int | None:  # the new round's rank 0, once it finished a step after resuming
        for pid in children(proc.pid):
            beat = _beat_of(pid) if pid not in first else None
            if beat is not None and beat.rank == 0 and beat.pid == pid and beat.restart >= 1 and beat.step >= 0:
                return pid
        return None

    wait_until(lambda: resumed_rank0() is not None, proc, poll=0.1)
    rank0 = resumed_rank0()
    assert rank0 is not None
    os.kill(rank0, signal.SIGSTOP)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err[-3000:]  # no restart left after the hang
    assert "resuming from" in out
    found = read_all(run)
    assert [(e["kind"], e["rank"]) for e in found] == [("worker-exit", 1), ("hang", 0)], found
    hang = found[-1]
    assert "rank 0 did not answer" in hang["message"] and "process state T" in hang["message"], hang
    stacks = (run / hang["stacks"]).read_text()
    assert "suspect: rank 0" in stacks and "=== rank 0" in stacks and "no stacks: it is stopped" in stacks
    assert stacks.count("File ") >= 1  # rank 1 answered with its frames
    assert [parse_log_line(line)["kind"] for line in err.splitlines()  # type: ignore[index]
            if parse_log_line(line) is not None] == ["worker-exit", "hang"], err[-3000:]

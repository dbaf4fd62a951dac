"""Run `kubetrain train` as several processes through torch.distributed.run (the elastic agent, c10d rendezvous).

The agent restarts the workers when one dies (up to --max-restarts); each restart resumes from the latest
checkpoint (`--resume auto`). A worker that exits 2 (bad input) or 75 (stopped on request) ends the group instead:
a restart cannot change either, and the launcher exits with that code. SIGTERM/SIGINT to the launcher reach the
workers, which finish their step, save a checkpoint and exit; the launcher then exits with EXIT_STOPPED_RESUMABLE.
While the agent runs, a thread watches the workers' heartbeats (launch/watch.py): a hang is dumped, ended and
restarted; every incident is recorded in `<run>/incidents/` and meta.json.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubetrain.distributed.peers import PEER_LOST as _PEER_LOST  # a peer went away: an effect, not a cause
from kubetrain.errors import (
    EXIT_BAD_INPUT,
    EXIT_FAILURE,
    EXIT_FINAL_FAILURE,
    EXIT_PREFLIGHT,
    EXIT_STOPPED_RESUMABLE,
    KubetrainError,
    RepeatableFailure,
    UserInputError,
    resume_hint,
)

# torch's switch between one store per rendezvous round for the workers ("1") and the agent's shared one (anything else)
SHARE_STORE_OFF_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


@dataclass(frozen=True)
class LaunchOptions:
    nproc_per_node: int = 1
    nnodes: str = "1"  # "M" or "MIN:MAX" (elastic)
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str = "kubetrain"
    max_restarts: int = 3  # a worker that dies is restarted and resumes from the latest checkpoint
    shutdown_timeout: int = 90  # how long workers get to save after SIGTERM
    monitor_interval: float = 0.5
    rdzv_conf: str | None = None  # e.g. "is_host=true": which node hosts the c10d store (set by k8s pods)
    local_addr: str | None = None  # the address this node advertises to the others (a pod's IP)
    hang_timeout: float | None = None  # dist.hang_timeout_seconds: no rank advancing this long is a hang
    hang_alert: float | None = None  # config/clocks.py: the hang alert's threshold, on the launcher's /metrics
    health_timeout: float | None = None  # config/clocks.py: the liveness clock of the launcher's /healthz
    metrics_port: int | None = None  # the launcher's /metrics (launch/watch.py watch_options); None: off
    metrics_host: str = "0.0.0.0"


def parse_nnodes(text: str) -> tuple[int, int]:
    try:
        lo, _, hi = text.partition(":")
        low, high = int(lo), int(hi or lo)
    except ValueError:
        raise UserInputError(f"--nnodes must be N or MIN:MAX, got '{text}'") from None
    if not 1 <= low <= high:
        raise UserInputError(f"--nnodes must satisfy 1 <= MIN <= MAX, got '{text}'")
    return low, high


def torchrun_args(opts: LaunchOptions, train_args: list[str]) -> list[str]:
    """The torch.distributed.run command line for these options and `kubetrain train` arguments."""
    if opts.nproc_per_node < 1:
        raise UserInputError("--nproc must be at least 1")
    _, high = parse_nnodes(opts.nnodes)
    if opts.node_rank is not None and opts.node_rank >= high:
        nodes = f"{high} node{'s' if high > 1 else ''}"
        raise UserInputError(f"--node-rank {opts.node_rank}: a job of {nodes} (--nnodes {opts.nnodes}) has node "
                             f"ranks 0 to {high - 1}")
    from kubetrain.torch_compat import torchrun_shutdown_args

    args = [f"--nproc-per-node={opts.nproc_per_node}", f"--max-restarts={opts.max_restarts}",
            f"--monitor-interval={opts.monitor_interval}", *torchrun_shutdown_args(opts.shutdown_timeout)]
    if high == 1 and opts.rdzv_endpoint is None:
        args.append("--standalone")  # c10d rendezvous on a free local port
    else:
        if not opts.rdzv_endpoint:
            raise UserInputError("several nodes need --rdzv-endpoint HOST:PORT (the same on every node)")
        host, _, port = opts.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise UserInputError(f"--rdzv-endpoint must be HOST:PORT, got '{opts.rdzv_endpoint}'")
        args += [f"--nnodes={opts.nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={opts.rdzv_endpoint}",
                 f"--rdzv-id={opts.rdzv_id}"]
        if opts.node_rank is not None:
            args.append(f"--node-rank={opts.node_rank}")
        if opts.rdzv_conf:
            args.append(f"--rdzv-conf={opts.rdzv_conf}")
        if opts.local_addr:
            args.append(f"--local-addr={opts.local_addr}")
    return [*args, "--module", "kubetrain", "train", *train_args]


def launch(opts: LaunchOptions, train_args: list[str], run_dir: Path) -> int:
    """Run the elastic agent in this process; the exit code says finished (0), stopped (75), bad input or failed."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousConnectionError
    from torch.distributed.run import parse_args, run

    from kubetrain.launch.hang_agreement import HangAgreement
    from kubetrain.launch.watch import HangWatch, launcher_metrics
    from kubetrain.torch_compat import elastic_agent
    from kubetrain.train.heartbeat import HEARTBEAT_DIR_ENV, LAUNCHER_PID_ENV

    args = parse_args(torchrun_args(opts, train_args))
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per worker unless told otherwise
    store_per_round(os.environ, _say)
    flight_recorder_env(run_dir)
    beats = Path(tempfile.mkdtemp(prefix="kubetrain-heartbeat-"))  # node-local: never the shared run folder
    os.environ[HEARTBEAT_DIR_ENV], os.environ[LAUNCHER_PID_ENV] = str(beats), str(os.getpid())
    watch = HangWatch(beats, run_dir, opts.hang_timeout, say=_say).start()
    exporter = launcher_metrics(watch, opts.metrics_port, opts.metrics_host, opts.hang_alert, _say,
                                opts.health_timeout)
    if opts.rdzv_endpoint and parse_nnodes(opts.nnodes)[1] > 1:  # the nodes' watches agree on the stuck rank
        agreement = HangAgreement(opts.rdzv_endpoint, opts.rdzv_id, parse_nnodes(opts.nnodes)[0])
        watch.agree, watch.published = agreement.agree, agreement.published
    gave_up = finished = stopped = False  # the launcher's /metrics says which to its last scrape
    # ours until the agent starts, then the agent's: the caller's own come back when the launch is over
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        _stop_is_an_exception(SignalException)  # a stop during the rendezvous, before the agent's own handler
        with elastic_agent(FINAL_EXIT_CODES, opts.shutdown_timeout, watch.agent_reaped):
            watch.agent_reports = _agent_extended()
            run(args)
        finished = True
    except SignalException as e:
        watch.stop()
        stopped = True  # a planned end (k8s stop, preemption): no KubetrainLauncherGone
        return _stopped_by_signal(e.sigval, run_dir, watch.last_step())
    except ChildFailedError as e:
        rank, failure = root_failure(e.failures)
        message = failure.message
        if isinstance(message, dict):
            message = message.get("message", json.dumps(message))
        if failure.exitcode == EXIT_STOPPED_RESUMABLE:
            watch.stop()
            return EXIT_STOPPED_RESUMABLE
        gave_up = True
        watch.finish(rank, str(message))
        if watch.hang_rounds and watch.last_incident and watch.last_incident["kind"] == "hang":
            hang = watch.last_incident
            _say(f"error: hang at step {hang['step']}: {hang['message']}; stacks in {run_dir / hang['stacks']}")
            return EXIT_FAILURE
        if failure.exitcode == EXIT_BAD_INPUT:  # the worker's own line, as one process would end
            _say(f"error: {message}")
            return EXIT_BAD_INPUT
        if failure.exitcode == EXIT_FINAL_FAILURE:  # failed for good (a NaN loss): its line, exit 1
            _say(f"error: {message}")
            return EXIT_FAILURE
        if failure.exitcode == EXIT_PREFLIGHT:  # a bad device or link before step 1: its line, and its code
            _say(f"error: {message}")
            return EXIT_PREFLIGHT
        _say(f"error: rank {rank} failed with exit code {failure.exitcode}: {message}")
        return EXIT_FAILURE
    except RendezvousConnectionError as e:  # an incident here; the caller decides the exit (pods: 69)
        watch.rendezvous_lost(opts.rdzv_endpoint, e)
        raise
    except RendezvousClosedError:  # another node's agent gave up (or ended) first: the same, a closed rendezvous
        watch.rendezvous_closed(opts.rdzv_id)
        raise
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        watch.stop()
        if exporter is not None:
            exporter.close(failed=gave_up, finished=finished, stopped=stopped)
        shutil.rmtree(beats, ignore_errors=True)
        _sync_incidents(run_dir)
    return 0


def store_per_round(environ: MutableMapping[str, str], say: Callable[[str], None]) -> None:
    """Workers get a fresh store (hosted by rank 0's agent on a free port) each rendezvous round instead of sharing
    the agent's: a node joining a later round deadlocks on the shared one (pytorch#135712), restarted gloo workers
    were seen reading a stale peer address from it, and the hang watch tells rounds apart by that store's address
    (heartbeat.round_identity), which a shared store keeps from round to round. torch shares it unless the variable
    is exactly "1", so a value the environment presets ("0", "true") is replaced, with one line saying so."""
    preset = environ.get(SHARE_STORE_OFF_ENV)
    if preset is not None and preset != "1":
        say(f"launcher: {SHARE_STORE_OFF_ENV}={preset} from the environment is replaced by 1: the workers need a "
            "store of their own each rendezvous round (a node joining a later round waits forever on the shared "
            "one, and the hang watch tells rounds apart by its address)")
    environ[SHARE_STORE_OFF_ENV] = "1"


def _stop_is_an_exception(exception: type[Exception]) -> None:
    """SIGTERM/SIGINT raise `exception` (torch's SignalException, with the signal) from now on, as the agent's own
    handler does once its workers start: a pod stopped while its launcher waits in the rendezvous (the other pods not
    up yet) then exits 75 with its line, not 143 with none."""

    def raise_stop(signum: int, frame: object) -> None:
        raise exception(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))  # type: ignore[call-arg]

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, raise_stop)


def _agent_extended() -> bool:
    """Whether torch_compat.elastic_agent put its agent in place, which reports every failed round to the watch
    (agent_reaped): then a worker the agent reaped without a report was stopped by it, not failed."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.launcher import api

    agent = getattr(api, "LocalElasticAgent", None)
    return isinstance(agent, type) and agent is not LocalElasticAgent and issubclass(agent, LocalElasticAgent)


def _where_the_run_stood(status: str | None, latest: str | None) -> str:
    """The run's state at a stop, as a person would write it (no `None` where nothing was there yet)."""
    state = f"run status {status}" if status not in (None, "unknown") else "the run had not started yet"
    saved = f"latest checkpoint {latest}" if latest else "no checkpoint yet (the run starts over)"
    return f"{state}; {saved}"


def _stopped_by_signal(sigval: signal.Signals, run_dir: Path, step: int | None) -> int:
    """The launcher's exit after SIGTERM/SIGINT: 1 when the run had failed (its meta.json says so), else 75 since
    nothing is lost (the workers' stop checkpoint, an earlier one, or none yet: the run starts over); SIGTERM is a
    `preempted` incident."""
    from kubetrain.runs import incidents

    status, latest = _run_status(run_dir)
    if sigval == signal.SIGTERM:
        _say(incidents.log_line(incidents.record(
            run_dir, "preempted", rank=None, step=step,
            message=f"SIGTERM to the launcher; {_where_the_run_stood(status, latest)}")))
    if _recorded_failure(run_dir):  # a stop does not turn a failure into a resumable run: the Job counts it
        _say(f"launcher: {sigval.name}: the run had failed before the stop; exiting {EXIT_FAILURE}")
        return EXIT_FAILURE
    if status == "stopped":
        _say(f"launcher: {sigval.name}: workers stopped (run status: {status})")
        return EXIT_STOPPED_RESUMABLE
    if latest is not None:  # the stop save did not finish in the grace period (rank 0 killed: status `failed`)
        _say(f"launcher: {sigval.name}: workers stopped before their stop checkpoint; the run resumes from {latest}")
        return EXIT_STOPPED_RESUMABLE
    _say(f"launcher: {sigval.name}: stopped before the first checkpoint: nothing to lose, the run starts "
         f"over; exiting {EXIT_STOPPED_RESUMABLE}, not a failure ({resume_hint()})")
    return EXIT_STOPPED_RESUMABLE


def _recorded_failure(run_dir: Path) -> bool:
    """The run's own record says it failed (rank 0 wrote `failed`), not only that its process is gone: a worker
    killed by the stop itself leaves `running` behind, which reads as `failed` once its process is gone."""
    from kubetrain import runs
    from kubetrain.runs.layout import PHASES_FILE

    if not run_dir.is_dir():
        return False
    folders = [run_dir, *runs.phase_dirs(run_dir)[-1:]]  # a run of phases: its newest phase's meta.json
    metas = [runs.read_meta(run_dir, PHASES_FILE), *(runs.read_meta(folder) for folder in folders)]
    return any(meta.get("status") == "failed" for meta in metas)


# A worker's exit that a restart cannot change: bad input (the same config fails the same way again), a stop it
# was asked for (a restart would resume and train on), a failure a resume would repeat (EXIT_FINAL_FAILURE) and a
# preflight that named a bad device or link (the same node fails again; the pod must move). Any
# other failure restarts the group, up to --max-restarts.
FINAL_EXIT_CODES = frozenset({EXIT_BAD_INPUT, EXIT_STOPPED_RESUMABLE, EXIT_FINAL_FAILURE, EXIT_PREFLIGHT})


def worker_exit_code(e: KubetrainError) -> int:
    """The exit code of a process that ends on `e`: its own, but EXIT_FINAL_FAILURE for a failure a restart would
    repeat, when this process is a worker of our launcher (which then exits 1 without restarting anyone)."""
    from kubetrain.train.heartbeat import LAUNCHER_PID_ENV

    if isinstance(e, RepeatableFailure) and os.environ.get(LAUNCHER_PID_ENV):
        return EXIT_FINAL_FAILURE
    return e.exit_code


FLIGHT_RECORDER_PREFIX = "nccl_trace_rank_"  # one file per rank in <run>/incidents/


def flight_recorder_env(run_dir: Path, env: MutableMapping[str, str] | None = None,
                        torch_version: tuple[int, int] | None = None) -> None:
    """On NCCL, keep the flight recorder's ring buffer and dump it into incidents/ when a collective times out.

    Environment only (torchtitan sets the same), under the names the torch of this process reads: its workers run
    the same torch, so a pod decides by its image's torch, not by the laptop that rendered it. A value already set
    under the other name of a pair (k8s.env, a pod spec) is kept and moved to the name read, so torch warns about
    no deprecated name (torch 2.13 reads the buffer size under gloo too, and warned about the old name there).
    """
    from kubetrain.runs.incidents import incidents_dir
    from kubetrain.torch_compat import FLIGHT_RECORDER_NAMES, flight_recorder_names

    env = os.environ if env is None else env
    names = flight_recorder_names(torch_version)
    for current, before, _ in FLIGHT_RECORDER_NAMES:
        other = before if names[current] == current else current
        if other in env:  # both set: the one this torch reads stays
            env.setdefault(names[current], env.pop(other))
    folder = incidents_dir(run_dir).resolve()
    try:
        folder.mkdir(parents=True, exist_ok=True)  # the dump does not create it
    except OSError:
        return
    env.setdefault(names["TORCH_FR_BUFFER_SIZE"], "2000")
    env.setdefault(names["TORCH_FR_DUMP_ON_TIMEOUT"], "1")
    env.setdefault(names["TORCH_FR_DUMP_TEMP_FILE"], str(folder / FLIGHT_RECORDER_PREFIX))


def _sync_incidents(run_dir: Path) -> None:
    """The workers are gone: meta.json's `incidents` can be written without racing rank 0."""
    from kubetrain import runs
    from kubetrain.runs.incidents import read_all

    found = read_all(run_dir)
    if found and (run_dir / runs.META_FILE).is_file():
        try:
            runs.update_meta(run_dir, incidents=found)
        except OSError as e:
            _say(f"launcher: warning: could not record the incidents in meta.json: {e}")


_ERRORS_SAID: list[str] = []  # the launcher's `error:` lines, for `--json`'s one object (cli.main)


def _say(message: str) -> None:
    if message.startswith("error: "):
        _ERRORS_SAID.append(message.removeprefix("error: "))
    print(message, file=sys.stderr, flush=True)


def last_error() -> str | None:
    """The last `error:` line this process's launcher said (without the prefix), or None."""
    return _ERRORS_SAID[-1] if _ERRORS_SAID else None


_AGENT_STOP_EXITS = (-signal.SIGTERM, -signal.SIGINT)  # Popen's exit code of a worker the agent's stop killed


def root_failure(failures: Mapping[int, Any]) -> tuple[int, Any]:
    """The failure that caused the others: torch's `get_first_failure` orders by timestamps of whole seconds
    (a tie goes to rank 0), so a worker whose collective failed because its peer was killed in the same second
    was reported instead of the killed peer. A failure that says a peer went away comes after every other, and so
    does a worker killed by the agent's own stop signal (the survivor it ended after another's exit: a rank that
    exited 75 made the agent SIGTERM the other, which read as `rank 0 failed with exit code -15`, exit 1)."""
    def order(item: tuple[int, Any]) -> tuple[bool, int, int]:
        rank, failure = item
        effect = bool(_PEER_LOST.search(str(failure.message))) or failure.exitcode in _AGENT_STOP_EXITS
        return effect, failure.timestamp, rank

    return min(failures.items(), key=order)


def _run_status(run_dir: Path) -> tuple[str, str | None]:
    """The run's status and its newest complete checkpoint (of its newest phase)."""
    from kubetrain.runs.reader import describe_run

    if not run_dir.is_dir():
        return "unknown", None
    info = describe_run(run_dir)
    return str(info["status"]), info["latest"]


def record_worker_error(e: BaseException) -> None:
    """Under the elastic agent, leave this rank's error where the launcher's failure summary reads it."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"message": f"{e}", "timestamp": int(time.time())}, f)

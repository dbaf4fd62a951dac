"""The launcher's watch over its workers: hangs (no rank advances), worker exits, and what to record of them.

A thread in the launcher reads the heartbeat files the workers write (train/heartbeat.py). When no rank of
this node has finished a step for `dist.hang_timeout_seconds`, it asks every worker for its Python stacks
(SIGUSR1: faulthandler), gives them a moment, writes them to `<run>/incidents/`, and SIGKILLs the workers;
torch's elastic agent sees them fail and restarts them (they resume from the latest checkpoint) while
restarts are left. A SIGSTOPped worker cannot answer: it is named as the suspect, with its process state.
A worker that exits on its own is recorded too (worker-exit, oom, timeout), once per restart round: the watch reads
its wait status while it is a zombie, or from the elastic agent that reaped it first (`agent_reaped`). Each
incident is also one `incident: ...` line on the launcher's stderr (incidents.log_line): in a pod, the log is
where `k8s status` finds it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kubetrain.config.clocks import derive
from kubetrain.distributed.peers import PEER_LOST
from kubetrain.runs import incidents
from kubetrain.train.heartbeat import STACKS_SIGNAL, stacks_file

if TYPE_CHECKING:
    from kubetrain.config.schema import Config
    from kubetrain.track.prometheus_launcher import LauncherExporter

STACKS_WAIT_SECONDS = 3.0  # how long a worker gets to write its stacks after SIGUSR1
# How long a look waits for the agent's word on a worker it reaped before the watch saw its status (the agent reports
# a failed round at once, before it restarts; a worker that exited 0 without its last beat is not reported at all).
REAPED_WAIT_SECONDS = 5.0
_TIMEOUT = re.compile(r"timed? ?out|timeout", re.IGNORECASE)
_OOM = re.compile(r"out of memory|OutOfMemoryError", re.IGNORECASE)


@dataclass
class Beat:
    rank: int
    pid: int
    step: int
    time: float
    restart: int
    error_file: str | None = None
    done: bool = False
    round: str = ""  # the rendezvous round's identity, the same on every node (heartbeat.round_identity)
    started: float = 0.0  # when the worker started beating: a later round's workers started later

    @classmethod
    def read(cls, path: Path) -> Beat | None:
        try:
            d = json.loads(path.read_text())
            return cls(int(d["rank"]), int(d["pid"]), int(d["step"]), float(d["time"]), int(d["restart"]),
                       d.get("error_file"), bool(d.get("done", False)), str(d.get("round") or ""),
                       float(d.get("started") or 0.0))
        except (OSError, ValueError, KeyError, TypeError):
            return None  # being replaced right now, or not ours: the next poll reads it

    @property
    def round_key(self) -> str:
        return self.round or f"restart {self.restart}"


def process_state(pid: int) -> tuple[str, int | None]:
    """(state letter from /proc: R running, S sleeping, T stopped, Z zombie, X gone; the wait status of a zombie)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return "X", None
    state = fields[0]
    status = int(fields[49]) if state == "Z" and len(fields) > 49 else None  # field 52: exit_code (Linux 3.5+)
    return state, status


def cause_order(beat: Beat, status: int | None) -> tuple[bool, bool, bool, float]:
    """Sort key of the workers found gone at one look: the one that caused the others first.

    A rank killed by a signal (kill -9, the OOM killer) dies first; its peers then fail in their collective
    ("Connection reset by peer": distributed/peers.py) and write that to their error files, or are ended by the
    agent with its stop signal (`stopped_by_agent`). Such effects come after every cause, whatever the heartbeat
    times say (the killed rank may have beaten last).
    """
    message = _error_message(beat.error_file) or ""
    return (bool(PEER_LOST.search(message)), stopped_by_agent(status), not (status is not None and status & 0x7F),
            beat.time)


def stopped_by_agent(status: int | None) -> bool:
    """Killed by SIGTERM/SIGINT: the agent's stop of a group it restarts (a peer failed or left) or ends. A worker
    asked to stop by anyone else handles the signal (train/stop.py) and exits 75; it is not killed by it."""
    return status is not None and status & 0x7F in (signal.SIGTERM, signal.SIGINT)


def describe_exit(status: int | None) -> str:
    if status is None:
        return "exited (status unknown: already reaped)"
    if status & 0x7F:
        return f"killed by {signal.Signals(status & 0x7F).name}"
    return f"exited with code {(status >> 8) & 0xFF}"


def wait_status(exitcode: int) -> int:
    """The wait status of a worker from the exit code torch's agent reports (Popen's: -N for signal N)."""
    return -exitcode & 0x7F if exitcode < 0 else (exitcode & 0xFF) << 8


def oom_kills() -> int | None:
    """The OOM kills counted in this process's cgroup (v2), so a SIGKILL can be told apart from the OOM killer."""
    try:
        rel = Path("/proc/self/cgroup").read_text().splitlines()[0].split("::", 1)[1]
        for line in Path(f"/sys/fs/cgroup{rel}/memory.events").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, IndexError, ValueError):
        pass
    return None


@dataclass
class HangWatch:
    """Polls the heartbeat folder from a thread of the launcher; `stop()` ends it."""

    folder: Path
    run_dir: Path
    hang_timeout: float | None
    poll_seconds: float = 0.25
    say: Any = print
    handled: set[str] = field(default_factory=set)  # rounds (Beat.round_key) whose end was recorded (or caused)
    last_incident: dict[str, Any] | None = None
    hang_rounds: set[str] = field(default_factory=set)
    on_incident: Callable[[dict[str, Any]], None] | None = None  # the launcher's exporter counts them
    # several nodes: publish this node's suspect, get the job's (launch/hang_agreement.py); None: decide alone
    agree: Callable[[str, dict[str, Any]], dict[str, Any]] | None = None
    # several nodes: the suspect other nodes already agreed on for a round (a hang declared there), or None
    published: Callable[[str], dict[str, Any] | None] | None = None
    reaped: dict[int, int] = field(default_factory=dict)  # pid -> wait status, from the agent (agent_reaped)
    agent_reports: bool = False  # the agent calls agent_reaped for every failed round (torch_compat.elastic_agent)
    _unknown_since: dict[int, float] = field(default_factory=dict)  # pid -> when first seen gone without a status
    _lock: threading.RLock = field(default_factory=threading.RLock)  # the watch's thread and the agent's
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _oom_at_start: int | None = None
    _started_at: float | None = None  # when this launch's watch started: incidents from before are not its own

    def start(self) -> HangWatch:
        self._oom_at_start = oom_kills()
        self._started_at = time.time()
        self._thread = threading.Thread(target=self._loop, name="kubetrain-hang-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            try:
                self.check()
            except OSError as e:  # the watch must never take the launcher down
                self.say(f"launcher: warning: hang watch: {e}")

    def beats(self) -> list[Beat]:
        """The heartbeats of the newest round: the one whose workers started last. An older round's files stay
        where a rank moved to another node (ranks are given out again at every rendezvous), and a membership
        change leaves this node's restart count as it was, so neither the files nor the count tell rounds apart."""
        found = [b for p in sorted(self.folder.glob("rank-*.json")) if (b := Beat.read(p)) is not None]
        if not found:
            return []
        newest = max(found, key=lambda b: (b.started, b.restart)).round_key
        return [b for b in found if b.round_key == newest]

    def check(self, now: float | None = None) -> None:
        """One look: a worker gone on its own is recorded; a job where no rank advanced for too long is a hang."""
        with self._lock:
            self._check(now)

    def agent_reaped(self, failures: Mapping[int, Any]) -> None:
        """torch's agent found failed workers (ProcessFailure by rank), reaped: their round is recorded now.

        Called from the agent's thread before it restarts the group or gives up, so a worker the agent reaped before
        the watch's look still has its status (`killed by SIGKILL`, not "status unknown").
        """
        with self._lock:
            self.reaped.update({f.pid: wait_status(f.exitcode) for f in failures.values()})
            try:
                self._check(None)
            except OSError as e:  # never the agent's problem
                self.say(f"launcher: warning: hang watch: {e}")

    def _check(self, now: float | None) -> None:
        beats = self.beats()
        if not beats or beats[0].round_key in self.handled:
            return
        live = [b for b in beats if not b.done]
        dead = [(b, *process_state(b.pid)) for b in live]
        gone = [(b, status if status is not None else self.reaped.get(b.pid))
                for b, state, status in dead if state in ("Z", "X")]
        unknown = [b.pid for b, status in gone if status is None]
        if unknown:  # reaped by the agent, which is about to say how it ended (agent_reaped)
            first = min(self._unknown_since.setdefault(pid, time.monotonic()) for pid in unknown)
            if time.monotonic() - first < REAPED_WAIT_SECONDS:
                return
        if gone and self.agent_reports and all(status is None for _, status in gone):
            # the agent reports every failed round before it acts (agent_reaped): one it reaped without a word was
            # stopped by it (a peer left, and the group restarts for the new membership), or exited 0 unbeaten
            self.handled.add(gone[0][0].round_key)
            self.say(self._hang_elsewhere(gone[0][0]) or f"launcher: rank {gone[0][0].rank} was ended by its agent "
                     "without a failure (the group restarts: a peer failed or left)")
            return
        if gone:
            known = [g for g in gone if g[1] is not None] if self.agent_reports else gone
            cause = min(known, key=lambda g: cause_order(*g))
            if cause_order(*cause)[0]:  # every one lost a peer: the cause is on another node, which records it
                self.handled.add(cause[0].round_key)
                self.say(self._hang_elsewhere(cause[0]) or f"launcher: rank {cause[0].rank} lost a peer on another "
                         "node (that node's launcher records the cause)")
                return
            if stopped_by_agent(cause[1]):  # an effect: the failure that made the agent stop them is recorded
                self.handled.add(cause[0].round_key)  # where it happened (here by agent_reaped, or on its node)
                self.say(self._hang_elsewhere(cause[0]) or f"launcher: rank {cause[0].rank} was "
                         f"{describe_exit(cause[1])}: its agent ended the round (a peer failed or left the group)")
                return
            self.record_exit(*cause)
            return
        now = time.time() if now is None else now
        newest = max(b.time for b in beats)
        if self.hang_timeout is not None and live and now - newest > self.hang_timeout:
            self.heal_hang(live, now - newest)

    def _hang_elsewhere(self, beat: Beat) -> str | None:
        """The line for a round this node's ranks left because another node's watch ended a hang there first (this
        watch, slower, saw a peer lost): the suspect the nodes agreed on, or None (no hang declared elsewhere)."""
        if self.published is None:
            return None
        try:
            chosen = self.published(beat.round_key)
        except (RuntimeError, OSError, ValueError):  # the store is gone: the plain line says what this node saw
            return None
        if chosen is None:
            return None
        return (f"launcher: hang: the stuck rank is rank {chosen['rank']} on another node (its launcher records the "
                f"incident); rank {beat.rank} of this node lost its peer")

    def record_exit(self, beat: Beat, status: int | None, failure_message: str | None = None) -> None:
        """A worker ended on its own: its kind (oom, timeout, worker-exit), rank and last step."""
        self.handled.add(beat.round_key)
        message = failure_message or _error_message(beat.error_file) or describe_exit(status)
        self.record_ended(beat.rank, beat.step, status, message)

    def record_ended(self, rank: int, step: int | None, status: int | None, message: str) -> None:
        """The incident of a worker that ended (`step` None: before its first step), of the kind its end says."""
        oom_now = oom_kills()
        kind: incidents.Kind = "worker-exit"
        if _OOM.search(message) or (status is not None and status & 0x7F == signal.SIGKILL
                                    and oom_now is not None and oom_now > (self._oom_at_start or 0)):
            kind = "oom"
        elif _TIMEOUT.search(message):
            kind = "timeout"
        self._oom_at_start = oom_now
        self.recorded(incidents.record(self.run_dir, kind, rank=rank, step=step,
                                       message=message.splitlines()[0][:500] if message else ""))

    def recorded(self, entry: dict[str, Any]) -> None:
        """An incident was written: one line on stderr, and a count on the launcher's /metrics."""
        self.last_incident = entry
        self.say(incidents.log_line(entry, self.run_dir))
        if self.on_incident is not None:
            self.on_incident(entry)

    def heal_hang(self, live: list[Beat], silent_for: float) -> None:
        """Dump every rank's stacks into incidents/, name the rank that did not answer (or advanced least), kill."""
        self.handled.add(live[0].round_key)
        self.hang_rounds.add(live[0].round_key)
        stacks = {b.rank: stacks_file(self.folder, b.rank) for b in live}
        offsets = {rank: p.stat().st_size if p.exists() else 0 for rank, p in stacks.items()}
        states = {b.rank: process_state(b.pid)[0] for b in live}
        for b in live:
            _signal(b.pid, STACKS_SIGNAL)
        deadline = time.monotonic() + STACKS_WAIT_SECONDS
        answered: set[int] = set()
        while time.monotonic() < deadline and len(answered) < len(live):
            time.sleep(0.1)
            answered = {r for r, p in stacks.items() if p.exists() and p.stat().st_size > offsets[r]}
        time.sleep(0.2)  # let the last writer finish its frames
        silent = [b for b in live if b.rank not in answered]
        suspect = min(silent or live, key=lambda b: (b.step, b.time))
        verdict = {"rank": suspect.rank, "step": suspect.step, "silent": bool(silent)}
        chosen = verdict
        if self.agree is not None:
            try:
                chosen = self.agree(live[0].round_key, verdict)
            except (RuntimeError, OSError, ValueError) as e:  # the store is gone too: decide alone
                self.say(f"launcher: warning: hang watch: could not compare with the other nodes ({e})")
        at = time.time()
        out = incidents.incidents_dir(self.run_dir) / f"{incidents.stamp(at)}-hang-stacks.txt"
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "w", encoding="utf-8") as f:
            # the job's suspect, as every node's file names it (this node's own guess may be a healthy rank that
            # waits in a collective for the stuck one)
            elsewhere = " (on another node)" if chosen["rank"] != suspect.rank else ""
            f.write(f"hang: no rank advanced for {silent_for:.0f}s; suspect: rank {chosen['rank']}{elsewhere}\n")
            for b in sorted(live, key=lambda b: b.rank):
                age = at - b.time
                f.write(f"\n=== rank {b.rank} (pid {b.pid}, process state {states[b.rank]}, last step {b.step}, "
                        f"heartbeat {age:.1f}s old) ===\n")
                if b.rank in answered:
                    with open(stacks[b.rank], encoding="utf-8", errors="replace") as s:
                        s.seek(offsets[b.rank])
                        f.write(s.read())
                else:
                    why = "it is stopped (SIGSTOP/T state)" if states[b.rank] == "T" else "it did not answer"
                    f.write(f"(no stacks: {why})\n")
        for b in live:
            _signal(b.pid, signal.SIGKILL)  # a stopped process dies of SIGKILL too; the agent then restarts
        if chosen["rank"] != suspect.rank:  # another node holds the stuck rank: its launcher records the hang
            self.say(f"launcher: hang: the stuck rank is rank {chosen['rank']} on another node (its launcher "
                     f"records the incident); workers of this node ended; stacks in {out}")
            return
        who = "did not answer" if silent else "advanced least"
        message = (f"no rank advanced for {silent_for:.0f}s; rank {suspect.rank} {who} "
                   f"(process state {states[suspect.rank]}); workers ended")
        self.recorded(incidents.record(self.run_dir, "hang", rank=suspect.rank, step=suspect.step,
                                       message=message, stacks=out))

    def rendezvous_lost(self, endpoint: str | None, error: BaseException) -> None:
        """The rendezvous host (node rank 0's launcher, which holds the c10d store) is gone: this node cannot go on."""
        cause = f": {error.__cause__}" if error.__cause__ else ""
        self.recorded(incidents.record(self.run_dir, "rendezvous-lost", rank=None, step=self.last_step(),
                                       message=f"lost the rendezvous host {endpoint}{cause}"))

    def rendezvous_closed(self, rdzv_id: str) -> None:
        """Another node's agent closed the rendezvous (it gave up, or ended): this node cannot join a new round."""
        self.recorded(incidents.record(self.run_dir, "rendezvous-closed", rank=None, step=self.last_step(),
                                       message=f"the rendezvous {rdzv_id} was closed by another node's agent"))

    def finish(self, failure_rank: int | None, failure_message: str | None) -> None:
        """After the agent gave up: record the failure that ended the last round, unless it was already."""
        self.stop()
        beats = self.beats()
        if beats and beats[0].round_key not in self.handled and failure_rank is not None:
            beat = next((b for b in beats if b.rank == failure_rank), beats[0])
            self.record_exit(beat, None, failure_message)
        elif not beats and failure_rank is not None and not self._recorded_since_start():
            # before any heartbeat (the preflight, the start-up): the agent's failure names the rank, no step yet
            self.record_ended(failure_rank, None, None, failure_message or "the worker ended before its first step")

    def _recorded_since_start(self) -> bool:
        """Whether an incident of this launch is already in the run folder (the preflight records its own)."""
        started = self._started_at
        return started is not None and any(e.get("time", 0) >= started for e in incidents.read_all(self.run_dir))

    def live_beats(self) -> list[Beat]:
        """The newest round's beats of workers still running (what the launcher's /metrics shows per rank)."""
        return [b for b in self.beats() if not b.done and process_state(b.pid)[0] not in ("Z", "X")]

    def health(self, liveness: float, now: float | None = None) -> tuple[bool, dict[str, Any]]:
        """(alive, details) of this node's workers by the liveness clock (config/clocks.py): the launcher's /healthz.

        Judged like the hang: no rank of the node finished a step for `liveness` seconds. It is a later clock than
        the watch's, so the watch names the stuck rank and saves the stacks before a probe can end the pod, and it
        is read here, in the launcher, because a stopped worker cannot answer for itself. Until the current round's
        first step (starting, or restarting after an incident) only the start-up collective timeout applies.
        """
        now = time.time() if now is None else now
        current = [b for b in self.beats() if b.round_key not in self.handled]
        if not current:
            return True, {"status": "starting", "timeout_seconds": liveness}
        if all(b.done for b in current):
            return True, {"status": "finished", "step": max(b.step for b in current), "timeout_seconds": liveness}
        age = now - max(b.time for b in current)
        alive = age <= liveness
        return alive, {"status": "ok" if alive else "stale", "step": max(b.step for b in current),
                       "seconds_since_step": round(age, 3), "timeout_seconds": liveness,
                       "ranks": {str(b.rank): {"step": b.step, "seconds_since_step": round(now - b.time, 3)}
                                 for b in sorted(current, key=lambda b: b.rank)}}

    def restart_round(self) -> int:
        """This node's agent's restarts (TORCHELASTIC_RESTART_COUNT of its newest round)."""
        return max((b.restart for b in self.beats()), default=0)

    def last_step(self) -> int | None:
        return max((b.step for b in self.beats()), default=None)


def watch_options(cfg: Config) -> dict[str, Any]:
    """The LaunchOptions fields of the watch and the launcher's /metrics, from the config's clocks."""
    clocks = derive(cfg)
    prom = cfg.track.prometheus
    port = (prom.port + 1 if prom.port else 0) if prom.enabled else None  # beside rank 0's exporter
    return {"hang_timeout": clocks.hang_watch, "hang_alert": clocks.alert, "health_timeout": clocks.liveness,
            "metrics_port": port, "metrics_host": prom.host}


def launcher_metrics(watch: HangWatch, port: int | None, host: str, alert_seconds: float | None,
                     say: Callable[[str], None], health_timeout: float | None = None) -> LauncherExporter | None:
    """Serve the launcher's /metrics and /healthz (track/prometheus_launcher.py) when asked to; a warning when it
    cannot. /healthz judges the workers by `health_timeout` (the liveness clock); None: it always answers 200."""
    if port is None:
        return None
    from kubetrain.track.failures import TrackerUnavailable
    from kubetrain.track.prometheus_launcher import LauncherExporter, RankBeat

    def beats() -> list[RankBeat]:
        return [RankBeat(b.rank, b.step, b.time) for b in watch.live_beats()]

    worker_port = port - 1 if port else None  # rank 0's exporter: track.prometheus.port (watch_options)
    def health() -> tuple[bool, dict[str, Any]]:
        return watch.health(health_timeout) if health_timeout is not None else (True, {"status": "unjudged"})

    exporter = LauncherExporter(port, host, watch.run_dir.name, alert_seconds or 0.0, beats, watch.restart_round,
                                worker_port, health)
    try:
        exporter.start()
    except (TrackerUnavailable, ImportError) as e:
        say(f"launcher: warning: {e}")
        return None
    watch.on_incident = exporter.incident
    return exporter


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _error_message(path: str | None) -> str | None:
    """What the worker wrote to torch elastic's error file before it died (record_worker_error, @record)."""
    if not path:
        return None
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    message = data.get("message")
    if isinstance(message, dict):
        message = message.get("message")
    return str(message) if message else None

"""The logs of every pod of a job, interleaved as they arrive, each line prefixed with where it came from.

A line is labelled by the pod's index (its node rank): `[pod 1] ` for the launcher's and the entrypoint's lines, and
`[pod 1 · rank 0] ` for a worker's (the trainer's `[rank R] ` prefix): after an elastic restart the rendezvous may
give global rank 0 to pod 1, so a pod's index alone would name the wrong rank.

A rank is read from its newest pod; the ranks are those the launched config asks for (k8s.nnodes), also
those with no pod yet. With --follow, a rank without a pod, a pod that is not scheduled or whose container
is still starting is waited for, saying why (the log endpoint answers an empty body or 400 until then), and
when a pod fails or is gone while its job is active, the rank is followed into the pod the controller makes
in its place. --follow ends only when the workload's own status says it has ended (or it is gone), and exits 1
when it failed. Without --follow, a rank that has no log yet is named with the reason, and the command exits 1.

A followed log ends when the container ends, and the pod's status says so only a few seconds later (the
kubelet reports it at its next sync): a pod that still says `Running` after its log ended is not the end. A
followed log can also end, or break off, while its container runs on (the API server restarts, a proxy or the
kubelet closes a long stream): then the stream is opened again from the time of the last line printed
(`timestamps` and `sinceTime`, as stern does), and the lines already printed are skipped. A stream that sends
nothing for `Patience.idle` seconds is opened again the same way: a stalled kubelet (a node under memory pressure)
keeps a stream open and silent, and a quiet container costs one request a minute.

With --follow, nothing the API server or a kubelet does ends the command; only the job's own status does (exit 0,
or 1 when it failed). A request that fails (the API server restarts, refuses with 429, times out) is tried again
with a growing wait, said once in one line (`(API server unreachable, retrying ...)`), and only an API server
that answers nothing for `Patience.give_up_after` seconds ends the command (one line, exit 1). What a kubelet or
the API server says about a log (an error in the stream's body: the kubelet's getContainerLogs writes a
failed ReadLogs' error into an answer it already began, pkg/kubelet/server/server.go) is one of our own
parenthesised lines, never a rank's line: every line a container wrote carries the runtime's stamp.
"""

from __future__ import annotations

import datetime
import queue
import re
import threading
import time
from collections.abc import Callable
from typing import Any

from kubetrain.errors import KubetrainError
from kubetrain.k8s.cluster.api import Cluster
from kubetrain.k8s.cluster.api_errors import ClusterError, NotFound, StreamBroken
from kubetrain.k8s.cluster.outage import GaveUp, Outage, Patience, unreachable
from kubetrain.k8s.cluster.status import Rank, job_ranks, log_time, main_container, waiting_reason
from kubetrain.k8s.cluster.waiting import expected_ranks, why_waiting, workload_object
from kubetrain.k8s.workloads import BY_KIND, finished

Emit = Callable[[str], None]
_DONE = object()
_RANK_PREFIX = re.compile(r"\[rank (\d+)\] ")  # the trainer's prefix of a worker's line (train/trainer.py)


class LogsIncomplete(KubetrainError):
    """Some ranks had no log to show (not scheduled, or not started)."""


class JobFailed(KubetrainError):
    """The followed job ended, and its controller says it failed."""


class ReaderFailed(KubetrainError):
    """A rank's reader ended on an error of our own (a bug, an answer it could not read): said, never dropped."""


def _not_started(pod: dict[str, Any]) -> str | None:
    """Why this pod's log cannot be read yet, or None when it can."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    waiting = any("waiting" in (s.get("state") or {}) for s in statuses)
    if not pod["spec"].get("nodeName") or waiting or not statuses:
        return waiting_reason(pod) or "waiting to start"
    return None


class _RankReader:
    """Reads one rank's log into the shared queue, following it across pod replacements when asked.

    A rank without a pod (not created yet, or gone while its job is active: being replaced) is waited for
    with --follow, saying why (waiting.why_waiting); without it, the rank is named with that reason.
    """

    def __init__(self, cluster: Cluster, job: str, namespace: str, number: int | None, rank: Rank | None,
                 lines: queue.Queue[Any], follow: bool, tail: int | None, poll: float,
                 outage: Outage | None = None) -> None:
        self.cluster, self.job, self.namespace, self.number = cluster, job, namespace, number
        self.rank, self.lines, self.follow, self.tail, self.poll = rank, lines, follow, tail, poll
        self.outage = outage or Outage(Patience(), lines, cluster.where)
        self.patience = self.outage.patience
        self.failures = 0  # failures since this rank's last line: how long the next wait is
        self.prefix = f"[pod {'?' if number is None else number}] "
        self.last_created = ""  # when this rank's last pod was made: older events about it are stale
        self.printed: tuple[int, int] | None = None  # the stamp of the container's last line printed (follow)
        self.printed_then: set[str] = set()  # the lines printed with that stamp
        self.broken = ""  # our last status line about this rank's stream (said once)
        self.unread = False  # the last stream did not end with its container: its pod's log may hold more
        self.left: set[str] = set()  # pods this rank was followed out of: never followed (nor printed) again

    def run(self) -> None:
        try:
            while True:
                try:
                    if not self._read_pod():
                        break
                except ClusterError as e:  # a request of the follow failed: wait, then carry on from where it was
                    if not self.follow:
                        raise
                    if unreachable(e):
                        self.outage.failed(e)
                    elif e.status in (401, 403):  # who we are: waiting changes nothing
                        raise
                    else:  # the API server answered, with an error about this rank's objects
                        self.outage.answered()
                        self._note(f"({e}; trying again)")
                    self._back_off()
        except KubetrainError as e:
            self.lines.put(e)
        except Exception as e:  # any other end of this thread would drop the rank without a word
            self.lines.put(ReaderFailed(f"rank {'?' if self.number is None else self.number}: reading its log "
                                        f"failed: {type(e).__name__}: {e}"))
        finally:
            self.lines.put(_DONE)

    def _labelled(self, text: str) -> str:
        """A container's line under one label: `[pod N] ` (the pod's index, its node rank) for the launcher's lines,
        `[pod N · rank R] ` for a worker's, whose own `[rank R] ` is its global rank (not the pod's index after a
        rendezvous gave the ranks out again, or with several workers per pod)."""
        found = _RANK_PREFIX.match(text)
        if found is None:
            return self.prefix + text
        return f"{self.prefix[:-2]} · rank {found.group(1)}] {text[found.end():]}"

    def _note(self, text: str) -> None:
        """One of our own status lines for this rank, said once while it stays the same."""
        if text != self.broken:
            self.lines.put(self.prefix + text)
            self.broken = text

    def _back_off(self) -> None:
        wait = min(self.patience.first_wait * 2 ** min(self.failures, 16), self.patience.longest_wait)
        self.failures += 1
        time.sleep(wait)

    def _refresh(self) -> Rank | None:
        """This rank's newest pod, or None while it has none the job runs now: a Job keeps a pod that failed (one
        that exited 75, replaced), which is the rank's newest again once the pod that replaced it is deleted; its
        lines were printed, and the pod the controller makes next is the one to follow."""
        found = job_ranks(self.cluster, self.job, self.namespace)
        self.outage.answered()
        rank = next((r for r in found if r.rank == self.number), None)
        return None if rank is None or rank.name in self.left else rank

    def _workload(self) -> dict[str, Any] | None:
        config_map = self.cluster.find("ConfigMap", f"{self.job}-config", self.namespace)
        found = workload_object(self.cluster, self.job, self.namespace, config_map)
        self.outage.answered()
        return found

    def _wait_for_pod(self) -> Rank | None:
        """This rank's pod once it exists; None when the job ended (or, without --follow, at once)."""
        noted = ""
        while (found := self._refresh()) is None:
            obj = self._workload()
            why = why_waiting(self.cluster, obj, self.number, self.last_created)
            if not self.follow:
                self.lines.put(LogsIncomplete(f"rank {self.number}: no pod: {why}"))
                return None
            if obj is None or finished(obj) is not None:
                if (found := self._refresh()) is not None:  # made, and done, between the two looks: its lines
                    return found
                self.lines.put(f"{self.prefix}(no pod: {why})")
                return None
            if why != noted:
                self.lines.put(f"{self.prefix}(no pod yet: {why})")
                noted = why
            time.sleep(self.poll)
        return found

    def _read_pod(self) -> bool:
        """Stream the current pod; True when there is more to follow (a restart or a replacement)."""
        if self.rank is None:
            self.rank = self._wait_for_pod()
            if self.rank is None:
                return False
        noted = ""
        while (why := _not_started(self.rank.pod)) is not None:
            if not self.follow:
                self.lines.put(LogsIncomplete(f"rank {self.rank.rank}: pod {self.rank.name} has no log yet: {why}"))
                return False
            if why != noted:
                self.lines.put(f"{self.prefix}(pod {self.rank.name} waiting: {why})")
                noted = why
            time.sleep(self.poll)
            self.last_created = str(self.rank.pod["metadata"].get("creationTimestamp") or "")
            self.rank = self._refresh()
            if self.rank is None:  # deleted before it started: wait for its replacement
                return True
        since = None if self.printed is None else _rfc3339(self.printed[0])
        try:
            for line in self.cluster.log_lines(self.rank.name, self.namespace, main_container(self.rank.pod),
                                               follow=self.follow, tail=self.tail if since is None else None,
                                               timestamps=self.follow, since_time=since,
                                               read_timeout=self.patience.idle if self.follow else None):
                self.failures = 0  # a line came: the wait after the next failure starts short again
                self.outage.answered()
                text = self._unseen(line) if self.follow else line
                if text is not None:
                    self.lines.put(self._labelled(text))
            self.unread = False
        except NotFound:
            if not self.follow:
                raise
        except ClusterError as e:
            if not self.follow:
                raise
            if "is waiting to start" in str(e):  # the kubelet's view lags the pod's
                time.sleep(self.poll)
                self.rank = self._refresh()
                return True
            self.unread = True  # the container may have written more than this stream gave
            if isinstance(e, StreamBroken):  # broken off (said once), or quiet for `idle` (said never)
                if not e.idle:
                    self._note(f"({e}; opening it again)")
            elif unreachable(e):
                self.outage.failed(e)
                self._back_off()
            elif e.status in (401, 403):  # who we are, not what the cluster goes through: no follow can help
                raise
            else:  # the API server answered for the kubelet (its node unreachable, a log it cannot read)
                self._note(f"({e}; opening it again)")
                self._back_off()
        return self.follow and self._next_pod()

    def _unseen(self, line: str) -> str | None:
        """A followed line without its stamp, or None when it was printed already (before the stream was opened
        again: `sinceTime` has whole seconds, the stamps nanoseconds)."""
        stamp, _, text = line.partition(" ")
        at = log_time(stamp)
        if at is None:  # every line the runtime took is stamped: this is the kubelet's error, sent in the stream
            self.unread = True
            self._note(f"(the log stream of pod {self.rank.name if self.rank else '?'} ended with the kubelet's "
                       f"error: {line.strip()[:300]}; opening it again)")
            return None
        if self.printed is not None and (at < self.printed or (at == self.printed and text in self.printed_then)):
            return None
        if at != self.printed:
            self.printed, self.printed_then = at, set()
        self.printed_then.add(text)
        return text

    def _new_instance(self, rank: Rank | None) -> None:
        """Follow another container (a replacement pod, a restart): its log starts afresh."""
        if self.unread and self.rank is not None:
            self._rest_of(self.rank.name)
        if self.rank is not None and (rank is None or rank.name != self.rank.name):  # not a restart in place
            self.left.add(self.rank.name)
        self.rank, self.tail, self.printed, self.printed_then, self.broken = rank, None, None, set(), ""
        self.unread = False

    def _rest_of(self, pod: str) -> None:
        """What the container of a pod being left behind wrote after the last line printed, when its stream broke
        off or stalled before its end (read once, not followed; a log that cannot be read is left)."""
        since = None if self.printed is None else _rfc3339(self.printed[0])
        try:
            for line in self.cluster.log_lines(pod, self.namespace, main_container(self.rank.pod) if self.rank
                                               else None, timestamps=True, since_time=since,
                                               read_timeout=self.patience.idle):
                text = self._unseen(line)
                if text is not None:
                    self.lines.put(self._labelled(text))
        except ClusterError:
            pass

    def _next_pod(self) -> bool:
        """After a followed stream ended: a replacement pod, a restarted container, or the end of the job.

        Only the workload's status ends a rank: a pod that still says Running (the kubelet has not reported its
        container's end yet), one that failed (its controller replaces it, or gives up) and one that succeeded
        while the job goes on (a JobSet or TrainJob may start it again) are all waited on."""
        assert self.rank is not None
        before = self.rank
        while True:
            now = self._refresh()
            if now is None:  # gone: a job still active replaces it (for a while neither pod exists)
                if self._workload_over():
                    return False
                self.lines.put(f"{self.prefix}(pod {before.name} is gone while the job is active: "
                               "it is being replaced)")
                self.last_created = str(before.pod["metadata"].get("creationTimestamp") or "")
                self._new_instance(None)
                return True
            if now.name != before.name:
                self.lines.put(f"{self.prefix}(pod {before.name} was replaced by {now.name}; following it)")
                self._new_instance(now)
                return True
            if _restarts(now.pod) > _restarts(before.pod):  # restarted in place: its new log starts empty
                self._new_instance(now)
                return True
            if self._workload_over():
                return False
            time.sleep(self.poll)
            if _running(now.pod):  # the stream ended, the container may not have: open it again from here
                self.rank = now
                return True

    def _workload_over(self) -> bool:
        obj = self._workload()
        return obj is None or finished(obj) is not None


def _running(pod: dict[str, Any]) -> bool:
    """The pod's status says its main container runs (which lags the container's end by a few seconds)."""
    name = main_container(pod)
    return any(c.get("name") == name and "running" in (c.get("state") or {})
               for c in (pod.get("status") or {}).get("containerStatuses") or [])


def _rfc3339(seconds: int) -> str:
    """`sinceTime`: an RFC 3339 time in whole seconds (metav1.Time), the second of a line's stamp."""
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _restarts(pod: dict[str, Any]) -> int:
    return sum(int(c.get("restartCount", 0)) for c in (pod.get("status") or {}).get("containerStatuses") or [])


def stream_logs(
    cluster: Cluster,
    name: str,
    namespace: str,
    *,
    follow: bool = False,
    rank: int | None = None,
    tail: int | None = None,
    emit: Emit = print,
    poll: float = 2.0,
    patience: Patience | None = None,
) -> int:
    """Print the ranks' logs line by line (one reader per rank); returns how many ranks were read.

    `patience`: with `follow`, how failed requests are retried and when the follow gives up (GaveUp, exit 1)."""
    found = {r.rank: r for r in job_ranks(cluster, name, namespace)}
    # the ranks the config asks for, also those without a pod yet (not created, or being replaced)
    expected = expected_ranks(cluster.find("ConfigMap", f"{name}-config", namespace)) or 0
    numbers = sorted(set(found) | set(range(expected)), key=lambda n: (n is None, n or 0))
    ranks = [n for n in numbers if rank is None or n == rank]
    if not ranks:
        which = f" with rank {rank}" if rank is not None else ""
        raise ClusterError(f"no pods{which} of job '{name}' in namespace {namespace} on {cluster.where}")
    lines: queue.Queue[Any] = queue.Queue(maxsize=1000)
    outage = Outage(patience or Patience(), lines, cluster.where)
    for number in ranks:
        reader = _RankReader(cluster, name, namespace, number, found.get(number), lines, follow, tail, poll, outage)
        threading.Thread(target=reader.run, daemon=True).start()
    open_streams, errors = len(ranks), []
    while open_streams:
        item = lines.get()
        if item is _DONE:
            open_streams -= 1
        elif isinstance(item, GaveUp):  # the other readers would only say the same
            raise item
        elif isinstance(item, KubetrainError):
            errors.append(item)
        else:
            emit(item)
    fatal = [e for e in errors if isinstance(e, ClusterError | GaveUp | ReaderFailed)]
    if fatal:
        raise fatal[0]
    if errors:
        raise LogsIncomplete("; ".join(sorted(str(e) for e in errors)))
    if follow:
        obj = _final_workload(cluster, name, namespace, outage)
        if obj is not None and finished(obj) == "failed":
            raise JobFailed(f"job '{name}' failed" + "".join(f": {why}" for why in _failed_because(obj))
                            + _cause(cluster, name, namespace))
    return len(ranks)


def _final_workload(cluster: Cluster, name: str, namespace: str, outage: Outage) -> dict[str, Any] | None:
    """The workload once every reader saw the job end, asked until the API server answers (or the follow gives up)."""
    failures = 0
    while True:
        try:
            return workload_object(cluster, name, namespace, cluster.find("ConfigMap", f"{name}-config", namespace))
        except ClusterError as e:
            outage.failed(e)
            p = outage.patience
            time.sleep(min(p.first_wait * 2 ** min(failures, 16), p.longest_wait))
            failures += 1


def _cause(cluster: Cluster, name: str, namespace: str) -> str:
    """`; ` and the newest failure of the job's pods (OOMKilled, evicted, exited N), or nothing."""
    from kubetrain.k8s.cluster.status import failure_of
    from kubetrain.k8s.workloads import pod_selector

    try:
        pods = cluster.list("Pod", namespace, pod_selector(name))
        failure = failure_of(pods, cluster.find("ConfigMap", f"{name}-config", namespace))
    except ClusterError:  # the job's own verdict stands alone
        return ""
    return f"; {failure['message']}" if failure else ""


def _failed_because(obj: dict[str, Any]) -> list[str]:
    """The reason and message of the workload's failed condition (e.g. BackoffLimitExceeded: Job has reached the
    specified backoff limit), those it has."""
    failed = BY_KIND[obj["kind"]].failed
    for condition in (obj.get("status") or {}).get("conditions") or []:
        if condition.get("type") == failed and condition.get("status") == "True":
            return [str(condition[k]) for k in ("reason", "message") if condition.get(k)]
    return []

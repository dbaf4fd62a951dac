"""Progress to Kubeflow Trainer's status server, so `kubectl get trainjob` shows it in `status.trainerStatus`.

The protocol (KEP-2779, kubeflow/trainer#3227; read in kubeflow/trainer at commit 008666ed, the newest stored):
- the controller's TrainJobStatus plugin injects three variables into every trainer container
  (pkg/runtime/framework/plugins/trainjobstatus/trainjobstatus.go): KUBEFLOW_TRAINER_SERVER_URL (an https URL
  ending in /apis/trainer.kubeflow.org/v1alpha1/namespaces/{ns}/trainjobs/{name}/status), and the paths of the
  CA certificate (KUBEFLOW_TRAINER_SERVER_CA_CERT) and of a projected service-account token
  (KUBEFLOW_TRAINER_SERVER_TOKEN, rotated by the kubelet: read it again for every request). Earlier development
  versions named them KUBEFLOW_TRAINER_STATUS_URL and KUBEFLOW_TRAINER_STATUS_SERVER_URL; the user guide of the
  release that shipped the feature (docs/user-guides/trainjob-progress.md, Trainer v2.2.0) uses these.
- `POST` with `Authorization: Bearer <token>` and a JSON body `{"trainerStatus": {...}}`
  (pkg/statusserver/server.go, UpdateTrainJobStatusRequest in pkg/apis/trainer/v1alpha1/trainjob_types.go):
  progressPercentage int32 0..100, estimatedRemainingSeconds int32 >= 0, metrics: at most 256 of
  {name, value}, both strings of 1..64 characters, lastUpdatedTime an RFC 3339 time (required by the CRD).
- 200 echoes the payload; errors are a metav1.Status JSON: 403 bad token, 422 invalid payload, 404 no such
  TrainJob, 413 over 64 KiB, 500.
- Clients throttle to one update per 5 seconds and never let reporting interrupt training (the user guide;
  the SDK's update_trainjob_status in kubeflow/sdk).

Posts leave from a background thread that always sends the newest status, so a slow or unreachable server costs
the training loop nothing; the first failure prints one warning line (never the token), later ones are silent.
"""

from __future__ import annotations

import json
import os
import ssl
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

from kubetrain.secrets import redact_text
from kubetrain.track import Sink
from kubetrain.track.failures import TrackerUnavailable

ENV_URL = "KUBEFLOW_TRAINER_SERVER_URL"
ENV_CA_CERT = "KUBEFLOW_TRAINER_SERVER_CA_CERT"
ENV_TOKEN = "KUBEFLOW_TRAINER_SERVER_TOKEN"
TIMEOUT_SECONDS = 5.0  # the SDK's; the server itself gives up reading a request after 10 s
MAX_METRICS = 256
MAX_TEXT = 64  # a metric's name and value
INT32_MAX = 2**31 - 1
# what metrics.jsonl calls them; the latest eval's val_loss/val_ppl ride along with every train update
METRIC_KEYS = ("step", "loss", "lr", "tokens", "tokens_per_second", "mfu", "epoch", "val_loss", "val_ppl",
               "slowest_rank", "straggler_ratio")


@dataclass(frozen=True)
class StatusServer:
    """Where the controller said to report: the URL, and the files holding its CA and our token."""

    url: str
    ca_cert: str | None
    token_file: str | None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> StatusServer | None:
        """None unless the controller injected the URL (the feature gate is on and this pod is a trainer)."""
        env = os.environ if env is None else env
        url = env.get(ENV_URL, "").strip()
        if not url:
            return None
        return cls(url, env.get(ENV_CA_CERT) or None, env.get(ENV_TOKEN) or None)


class StatusNotSent(Exception):
    """One update did not arrive; the message is one line, without the token."""


def trainer_status(progress: int | None, remaining: float | None, metrics: Mapping[str, Any],
                   observed: float) -> dict[str, Any]:
    """The request body: {"trainerStatus": {...}} with the types and limits the CRD validates."""
    status: dict[str, Any] = {}
    if progress is not None:
        status["progressPercentage"] = max(0, min(100, int(progress)))
    if remaining is not None and remaining == remaining:  # not NaN
        status["estimatedRemainingSeconds"] = max(0, min(INT32_MAX, round(remaining)))
    items = [{"name": name[:MAX_TEXT], "value": _metric_text(value)} for name, value in metrics.items()
             if value is not None and name]
    if items:
        status["metrics"] = items[:MAX_METRICS]
    status["lastUpdatedTime"] = datetime.fromtimestamp(observed, UTC).isoformat(timespec="seconds")
    return {"trainerStatus": status}


def _metric_text(value: Any) -> str:
    text = format(value, ".6g") if isinstance(value, float) else str(value)
    return text[:MAX_TEXT] or "-"


def post_status(server: StatusServer, body: dict[str, Any], timeout: float = TIMEOUT_SECONDS) -> None:
    """One HTTPS POST, verifying the server with the given CA and sending the token read just now."""
    try:
        if not server.token_file:
            raise StatusNotSent(f"{ENV_TOKEN} is not set")
        with open(server.token_file, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as e:
        raise StatusNotSent(f"cannot read the token ({ENV_TOKEN}): {e.strerror or e}") from None
    try:
        # with a cafile, only that CA is trusted (no system store): the controller's certificate is self-made
        context = ssl.create_default_context(cafile=server.ca_cert)
    except (OSError, ssl.SSLError) as e:
        raise StatusNotSent(f"cannot load the CA certificate ({ENV_CA_CERT}): {getattr(e, 'strerror', None) or e}"
                            ) from None
    request = urllib.request.Request(
        server.url, data=json.dumps(body).encode(), method="POST",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            response.read()
    except urllib.error.HTTPError as e:
        raise StatusNotSent(f"HTTP {e.code} {_status_message(e)}") from None
    except urllib.error.URLError as e:
        raise StatusNotSent(str(e.reason)) from None
    except (OSError, ValueError) as e:  # a timeout while reading, a reset connection, a malformed URL
        raise StatusNotSent(f"{type(e).__name__}: {e}") from None


def _status_message(error: urllib.error.HTTPError) -> str:
    """The message of the metav1.Status the server answers errors with (else the HTTP reason)."""
    try:
        return str(json.loads(error.read(4096)).get("message") or error.reason)
    except (ValueError, AttributeError, OSError):
        return str(error.reason)


class KubeflowTrainerSink(Sink):
    """Rank 0's progress, ETA and latest metrics, sent at most once per interval and once more at the end."""

    name = "kubeflow-trainer"

    def __init__(self, server: StatusServer, interval_seconds: float = 5.0, warn: Callable[[str], None] | None = None,
                 stream: Any = None, timeout: float = TIMEOUT_SECONDS) -> None:
        self.server = server
        self.interval = interval_seconds
        self.timeout = timeout
        self.stream = stream
        self._warn = warn or (lambda msg: print(f"warning: {msg}", file=sys.stderr, flush=True))
        self.total = 0
        self.phase: str | None = None
        self.metrics: dict[str, Any] = {}  # the latest value of each, an eval's included
        self._last_progress: int | None = None
        self._last_eta: float | None = None
        self.sent = 0
        self.failed = 0
        self._cond = threading.Condition()
        self._pending: dict[str, Any] | None = None
        self._closing = False
        self._last_post = -float("inf")
        self._thread: threading.Thread | None = None

    def start(self, info: dict[str, Any]) -> None:
        if urlsplit(self.server.url).scheme != "https":
            # the token must never travel in clear text
            raise TrackerUnavailable(f"{ENV_URL} is not an https URL: {redact_text(self.server.url)}")
        self.total = int(info.get("max_steps") or 0)
        self.phase = info.get("phase")
        self._thread = threading.Thread(target=self._run, name="kubeflow-trainer-status", daemon=True)
        self._thread.start()
        print(f"kubeflow trainer: reporting progress to {redact_text(self.server.url)}",
              file=self.stream or sys.stdout, flush=True)

    def log(self, record: dict[str, Any]) -> None:
        kind = record.get("kind")
        if kind not in ("train", "eval"):
            return
        self.metrics.update({k: record[k] for k in METRIC_KEYS if record.get(k) is not None})
        if kind == "train":
            step = int(record["step"])
            # 100 only once the run has finished: a run at its last step still evaluates and saves
            progress = min(99, 100 * step // self.total) if self.total else None
            self._offer(progress, record.get("eta_seconds"), float(record.get("time") or time.time()))
        else:
            self._offer(self._last_progress, self._last_eta, float(record.get("time") or time.time()))

    def _offer(self, progress: int | None, eta: float | None, observed: float) -> None:
        self._last_progress, self._last_eta = progress, eta
        metrics = dict(self.metrics)
        if self.total:
            metrics["max_steps"] = self.total
        if self.phase:
            metrics["phase"] = self.phase
        with self._cond:
            self._pending = trainer_status(progress, eta, metrics, observed)
            self._cond.notify()

    def finish(self, status: str) -> None:
        if self._thread is None:
            return
        if status == "finished":
            self._offer(100, 0.0, time.time())
        with self._cond:
            self._closing = True  # the last status goes out now, not after the interval
            self._cond.notify()
        self._thread.join(self.timeout + 1.0)

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._pending is not None:
                        wait = self._last_post + self.interval - time.monotonic()
                        if self._closing or wait <= 0:
                            break
                    elif self._closing:
                        return
                    else:
                        wait = None
                    self._cond.wait(wait)
                body, self._pending = self._pending, None
            self._last_post = time.monotonic()
            self._send(body)

    def _send(self, body: dict[str, Any]) -> None:
        try:
            post_status(self.server, body, self.timeout)
        except Exception as e:  # StatusNotSent, or a bug here: either way training must not notice
            self.failed += 1
            if self.failed == 1:
                self._warn(redact_text(
                    f"kubeflow trainer: cannot report progress to {self.server.url}: {e} (training goes on; "
                    f"retrying every {self.interval:g}s without further warnings)"))
            return
        self.sent += 1

"""MLflow: params = the flattened resolved config, metrics each log step, config.yaml + meta.json, run status.

One kubetrain run (or phase) is one MLflow run: a resumed run finds its MLflow run again by a tag that holds
a digest of the run directory, so pod restarts do not scatter one training run over many MLflow runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from kubetrain.config.loading import flatten
from kubetrain.runs import CONFIG_FILE, META_FILE
from kubetrain.secrets import redact, redact_text
from kubetrain.track import Sink
from kubetrain.track.failures import TrackerUnavailable, missing_package, one_line

# MLflow's HTTP client retries for minutes by default; a tracker that is down must cost seconds, not the run.
FAIL_FAST_ENV = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0.5",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}
STATUS = {"finished": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}
RUN_KEY_TAG = "kubetrain_run_key"
PARAMS_PER_BATCH = 100  # MLflow's limit per log_batch call
NOT_METRICS = {"kind", "step", "time", "phase"}


def tracking_uri(configured: str | None, output_dir: str | Path) -> str:
    """The configured URI, else $MLFLOW_TRACKING_URI, else a SQLite file next to the runs."""
    if configured:
        return configured
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{Path(output_dir).expanduser().resolve() / 'mlflow.db'}"


def default_artifact_location(uri: str, output_dir: str | Path) -> str | None:
    """Artifacts next to the runs for database stores (MLflow would use ./mlruns in the working directory,
    read-only in a hardened pod); a tracking server decides for itself."""
    if uri.split(":", 1)[0].lower() in ("http", "https", "databricks"):
        return None
    return (Path(output_dir).expanduser().resolve() / "mlartifacts").as_uri()


def run_key(run_dir: str | Path) -> str:
    return hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]


class MlflowSink(Sink):
    name = "mlflow"

    def __init__(
        self, uri: str, experiment: str, artifact_location: str | None = None, stream: Any = None
    ) -> None:
        self.uri = uri
        self.experiment = experiment
        self.artifact_location = artifact_location
        self.stream = stream
        self.client: Any = None
        self.run_id: str | None = None
        self.run_dir: Path | None = None

    def start(self, info: dict[str, Any]) -> None:
        for key, value in FAIL_FAST_ENV.items():
            os.environ.setdefault(key, value)
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise missing_package("mlflow") from None
        self.run_dir = Path(info["run_dir"])
        try:
            self.client = MlflowClient(tracking_uri=self.uri)
            self.run_id = self._open_run(info)
        except Exception as e:
            raise TrackerUnavailable(f"cannot use MLflow at {redact_text(self.uri)}: {one_line(e)}") from None
        print(f"mlflow: run {self.run_id} in experiment '{self.experiment}' at {redact_text(self.uri)}",
              file=self.stream or sys.stdout, flush=True)

    def _open_run(self, info: dict[str, Any]) -> str:
        from mlflow.entities import Param, RunTag

        client = self.client
        exp = client.get_experiment_by_name(self.experiment)
        if exp is not None:
            exp_id = exp.experiment_id
        else:
            try:
                exp_id = client.create_experiment(self.experiment, artifact_location=self.artifact_location)
            except Exception:  # another run created it meanwhile
                exp = client.get_experiment_by_name(self.experiment)
                if exp is None:
                    raise
                exp_id = exp.experiment_id
        key = run_key(info["run_dir"])
        found = client.search_runs([exp_id], filter_string=f"tags.{RUN_KEY_TAG} = '{key}'", max_results=1)
        phase = info.get("phase")
        tags = {RUN_KEY_TAG: key, "kubetrain.run_dir": redact_text(str(Path(info["run_dir"]).resolve())),
                "kubetrain.phase": phase or "", "kubetrain.restarts": str(info.get("restarts", 0)),
                "kubetrain.start_step": str(info.get("start_step", 0))}
        if found:
            run_id = str(found[0].info.run_id)
            client.update_run(run_id, status="RUNNING")
            logged = dict(found[0].data.params)
        else:
            name = redact_text(f"{info.get('run')}/{phase}" if phase else str(info.get("run")))
            run_id = str(client.create_run(exp_id, run_name=name, tags=tags).info.run_id)
            logged = {}
        params = self.params(info)
        # MLflow params cannot change once logged: a resume records only keys it has not seen; the config it
        # really ran with is in the config.yaml artifact.
        fresh = [Param(k, v) for k, v in params.items() if k not in logged]
        for i in range(0, len(fresh), PARAMS_PER_BATCH):
            client.log_batch(run_id, params=fresh[i : i + PARAMS_PER_BATCH])
        client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])
        return run_id

    @staticmethod
    def params(info: dict[str, Any]) -> dict[str, str]:
        """The flattened resolved config (secrets redacted) plus parameter count and world size."""
        cfg = info.get("config")
        raw = redact(cfg.model_dump(mode="json")) if cfg is not None else {}
        out = {k: _param_text(v) for k, v in flatten(raw).items()}
        out["n_params"] = str(info.get("params"))
        out["world_size"] = str(info.get("world_size", 1))
        out["max_steps_resolved"] = str(info.get("max_steps"))
        return out

    def log(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric, RunTag

        assert self.run_id is not None
        step = int(record.get("step", 0))
        ms = int(1000 * float(record.get("time") or time.time()))
        if record.get("kind") == "checkpoint":
            tag = RunTag("kubetrain.last_checkpoint", Path(record["path"]).name)
            self.client.log_batch(self.run_id, tags=[tag])
            return
        skip = NOT_METRICS | ({"tokens"} if record.get("kind") == "eval" else set())
        metrics = [Metric(k, float(v), ms, step) for k, v in record.items()
                   if k not in skip and isinstance(v, int | float) and not isinstance(v, bool)]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def finish(self, status: str) -> None:
        if self.run_id is None:
            return
        try:
            for name in (CONFIG_FILE, META_FILE):
                if self.run_dir is not None and (self.run_dir / name).is_file():
                    # the redacted text, not the file: a run directory written by an older kubetrain (or edited
                    # by hand) may hold secrets that must not reach the tracking server
                    self.client.log_text(self.run_id, redacted_file_text(self.run_dir / name), name)
        finally:
            # the status must reach MLflow even when an artifact upload fails
            self.client.set_terminated(self.run_id, STATUS.get(status, "FAILED"))


def redacted_file_text(path: Path) -> str:
    """A YAML or JSON file's text with its secrets redacted the way the params are (by key and by value)."""
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".json":
            return json.dumps(redact(json.loads(text)), indent=2)
        return yaml.safe_dump(redact(yaml.safe_load(text)), sort_keys=False)
    except (ValueError, yaml.YAMLError):
        return redact_text(text)  # not what it claims to be: still never sent as it is


def _param_text(value: Any) -> str:
    return "" if value is None else str(value)

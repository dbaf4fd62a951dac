"""The `track:` section: which metric sinks are on, and where they send metrics."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from kubetrain.config.section import Section
from kubetrain.secrets import is_secret_key

# scheme://user:password@host: a password in the config would land in config.yaml and the run's params.
_URL_PASSWORD = re.compile(r"^[a-z][a-z0-9+.-]*://[^/@\s]*:[^/@\s]*@", re.IGNORECASE)


class MlflowConfig(Section):
    enabled: bool = Field(default=False, description="Log params, metrics, artifacts and status to MLflow.")
    tracking_uri: str | None = Field(
        default=None,
        description="Any MLflow tracking URI (http://..., postgresql://user@host/db, sqlite:///...). "
        "Default: $MLFLOW_TRACKING_URI, else sqlite:///<output_dir>/mlflow.db. Passwords go in the "
        "environment (PGPASSWORD, MLFLOW_TRACKING_PASSWORD), never here.",
    )
    experiment: str = Field(default="kubetrain", min_length=1, description="Experiment (created if missing).")
    artifact_location: str | None = Field(
        default=None,
        description="Where a new experiment keeps artifacts. Default: <output_dir>/mlartifacts for database "
        "URIs; the server's choice for http(s) servers.",
    )

    @field_validator("tracking_uri")
    @classmethod
    def _no_password(cls, v: str | None) -> str | None:
        if v and _URL_PASSWORD.match(v):
            raise ValueError(
                "must not contain a password (it would be written to config.yaml); put it in PGPASSWORD "
                "or MLFLOW_TRACKING_PASSWORD, or the whole URI in MLFLOW_TRACKING_URI"
            )
        return v


class TensorboardConfig(Section):
    enabled: bool = Field(default=False, description="Write TensorBoard event files.")
    dir: str | None = Field(
        default=None,
        description="Root for event files, one folder per run: <dir>/<run name>[/<phase>] "
        "(default: <run dir>/tensorboard).",
    )


class PrometheusConfig(Section):
    enabled: bool = Field(default=False, description="Serve /metrics and /healthz (liveness) on rank 0.")
    port: int = Field(default=9400, ge=0, le=65535, description="Port of /metrics, /healthz (0: any).")
    host: str = Field(default="0.0.0.0", description="Address to listen on (0.0.0.0: a pod can be scraped).")
    health_timeout_seconds: float | None = Field(
        default=None,
        gt=0,
        description="/healthz answers 503 once no training step finished for this long (a hung collective "
        "or data loader), so a liveness probe restarts the pod (null: derived, after the collective timeout "
        "and checkpoint.grace_seconds, see config/clocks.py). Keep it above the slowest eval + checkpoint save.",
    )


class KubeflowTrainerConfig(Section):
    enabled: bool = Field(
        default=True,
        description="In a TrainJob whose Kubeflow Trainer has the TrainJobStatus feature gate on (it injects "
        "KUBEFLOW_TRAINER_SERVER_URL), report progress, ETA and metrics to its status server, shown in the "
        "TrainJob's status.trainerStatus. Elsewhere it does nothing.",
    )
    interval_seconds: float = Field(
        default=5.0,
        ge=1.0,
        description="At most one update per this many seconds (Kubeflow asks clients for 5 s or more); the "
        "final status is sent when the run ends.",
    )
    controller_namespace: str = Field(
        default="kubeflow-system",
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        description="Namespace of the Trainer controller, whose status server a TrainJob's pods may reach when "
        "k8s.network_policy.egress is on.",
    )
    controller_port: int = Field(
        default=10443, ge=1, le=65535, description="Port of the controller's status server (its default: 10443)."
    )


_NOT_IN_A_WANDB_PROJECT = "/\\#?%:"


class WandbConfig(Section):
    """Weights & Biases. The API key is read from WANDB_API_KEY only (a Kubernetes Secret through
    k8s.secrets.env), never from here: config.yaml is written to the run directory and shown by print-config."""

    enabled: bool = Field(default=False, description="Log the config, metrics, the final sample (and checkpoints) "
                          "to Weights & Biases (pip install 'kubetrain[wandb]').")
    project: str = Field(default="kubetrain", min_length=1, max_length=128, description="W&B project.")
    entity: str | None = Field(default=None, description="W&B team or user (default: the key's default entity).")
    mode: Literal["auto", "online", "offline", "disabled"] = Field(
        default="auto",
        description="auto: $WANDB_MODE when set, else online when WANDB_API_KEY is set, else offline (the run is "
        "written under <run dir>/wandb for `wandb sync`). online without WANDB_API_KEY needs a `wandb login`.",
    )
    tags: list[str] = Field(default_factory=list, description="Tags of the W&B run (64 characters each at most).")
    log_checkpoints: bool = Field(
        default=False,
        description="Each saved checkpoint as a 'model' artifact (model-<W&B run id>, aliases step-N, latest, best). "
        "W&B copies it to its staging folder first: disk and time on rank 0 at each save.",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_key_here(cls, data: Any) -> Any:
        for name in data if isinstance(data, dict) else ():
            if is_secret_key(str(name)) or str(name).lower() in ("key", "wandb_api_key"):
                raise ValueError(f"'{name}': the W&B key is never read from the config (config.yaml would keep it); "
                                 "set WANDB_API_KEY in the environment (on Kubernetes: a Secret through "
                                 "k8s.secrets.env)")
        return data

    @field_validator("project")
    @classmethod
    def _project(cls, value: str) -> str:
        # W&B's own rule (wandb_settings.Settings.validate_project): refused here, not by the run at its start
        found = sorted(set(value) & set(_NOT_IN_A_WANDB_PROJECT))
        if found:
            raise ValueError(f"'{value}' may not contain {' '.join(found)} (W&B refuses any of "
                             f"{' '.join(_NOT_IN_A_WANDB_PROJECT)} in a project name; the team goes in entity)")
        return value

    @field_validator("tags")
    @classmethod
    def _tags(cls, value: list[str]) -> list[str]:
        for tag in value:
            if not 0 < len(tag) <= 64:  # W&B refuses the run otherwise
                raise ValueError(f"tag '{tag[:70]}' must have 1 to 64 characters")
        return value


class TrackConfig(Section):
    console: bool = Field(default=True, description="Progress on stdout (rich on a terminal).")
    mlflow: MlflowConfig = Field(default_factory=lambda: MlflowConfig(), description="MLflow tracking.")
    tensorboard: TensorboardConfig = Field(
        default_factory=lambda: TensorboardConfig(), description="TensorBoard event files."
    )
    prometheus: PrometheusConfig = Field(
        default_factory=lambda: PrometheusConfig(), description="Prometheus /metrics and /healthz."
    )
    kubeflow_trainer: KubeflowTrainerConfig = Field(
        default_factory=lambda: KubeflowTrainerConfig(),
        description="Progress to Kubeflow Trainer's status server (TrainJob status.trainerStatus).",
    )
    wandb: WandbConfig = Field(default_factory=lambda: WandbConfig(), description="Weights & Biases.")

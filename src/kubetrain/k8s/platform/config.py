"""The platform's own config file (`kubetrain k8s platform render [PLATFORM.yaml]`): one per namespace.

It is not a training config: a team renders the platform once, and every job's config then names the
tracking server (`track.mlflow.tracking_uri: http://kubetrain-mlflow:5000`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, field_validator

from kubetrain.config.loading import read_yaml
from kubetrain.config.section import Section
from kubetrain.errors import ConfigError

_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_QUANTITY = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?$"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SECRET_NAME = re.compile(r"(TOKEN|PASSWORD|PASSWD|SECRET|API_?KEY|CREDENTIAL)", re.IGNORECASE)
KUBETRAIN_IMAGE = "ghcr.io/kubetrain/kubetrain:0.1.0"


class PostgresConfig(Section):
    uri: str | None = Field(
        default=None,
        description="postgresql://USER@HOST:PORT/DB of an existing database (no password: it comes from the "
        "Secret). Unset: a PostgreSQL StatefulSet is rendered in the namespace.",
    )
    secret_name: str = Field(
        default="kubetrain-postgres", pattern=_DNS_LABEL,
        description="Secret holding the database password (created by you, never rendered).",
    )
    secret_key: str = Field(default="password", min_length=1, description="Key of the password in the Secret.")
    image: str = Field(default="postgres:16", min_length=1, description="PostgreSQL image of the StatefulSet.")
    uid: int = Field(default=999, ge=1, description="The image's postgres user id (999 in the official image).")
    size: str = Field(default="10Gi", description="Size of the StatefulSet's data claim.")
    storage_class: str | None = Field(default=None, description="Storage class of the data claim.")

    @field_validator("uri")
    @classmethod
    def _database_uri(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if not value.startswith(("postgresql://", "postgresql+psycopg2://", "postgresql+psycopg://")):
            raise ValueError(f"must be a postgresql:// URI, got '{value}'")
        userinfo = value.split("://", 1)[1].split("@", 1)
        if len(userinfo) == 2 and ":" in userinfo[0]:
            raise ValueError("must not hold a password: the pods read it from postgres.secret_name")
        return value


class ArtifactsConfig(Section):
    uri: str | None = Field(
        default=None,
        description="Object store for artifacts (s3://bucket/prefix, like checkpoint.uri); the server proxies "
        "uploads. Unset: a claim of `size` mounted at /artifacts.",
    )
    endpoint_url: str | None = Field(default=None, description="S3-compatible endpoint (MinIO, SeaweedFS, Ceph).")
    secret_name: str | None = Field(
        default=None, description="Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY for `uri`.",
    )
    size: str = Field(default="20Gi", description="Size of the artifact claim (without `uri`).")
    storage_class: str | None = Field(default=None, description="Storage class of the artifact claim.")


class MlflowAuthConfig(Section):
    enabled: bool = Field(
        default=False,
        description="Run MLflow's basic-auth app (`mlflow server --app-name basic-auth`): every request but "
        "/health needs a user and password. Off: only the NetworkPolicy stands in front of the server.",
    )
    secret_name: str = Field(
        default="kubetrain-mlflow-auth", pattern=_DNS_LABEL,
        description="Secret (created by you, never rendered) with the admin password and the Flask secret key.",
    )
    password_key: str = Field(
        default="admin-password", min_length=1,
        description="Key of the admin's password in the Secret (MLFLOW_AUTH_ADMIN_PASSWORD; used when the "
        "server first creates the admin, later changes go through MLflow's update-password API).",
    )
    flask_secret_key: str = Field(
        default="flask-secret-key", min_length=1,
        description="Key of the Flask secret key (CSRF) in the Secret (MLFLOW_FLASK_SERVER_SECRET_KEY).",
    )
    admin_username: str = Field(default="admin", min_length=1, description="The admin user MLflow creates.")
    default_permission: Literal["READ", "EDIT", "MANAGE", "NO_PERMISSIONS"] = Field(
        default="READ", description="What every signed-in user may do with experiments they were not given. With "
        "READ a job's own user needs an EDIT grant on its experiment (`kubetrain k8s platform grant`); EDIT lets "
        "every signed-in user write to every experiment.",
    )


class MlflowServerConfig(Section):
    enabled: bool = Field(default=True, description="Render the MLflow tracking server (and its database).")
    image: str = Field(
        default=KUBETRAIN_IMAGE, min_length=1,
        description="Image with `mlflow` and a PostgreSQL driver (kubetrain's image has both).",
    )
    run_as_user: int = Field(default=1000, ge=1, description="The image's non-root user id (1000 in kubetrain's).")
    port: int = Field(default=5000, ge=1024, le=65535, description="Port of the server and its Service.")
    workers: int = Field(
        default=2, ge=1,
        description="uvicorn worker processes (about 250 MiB each): two, so one slow request (a large artifact "
        "the server proxies) does not hold up the others.",
    )
    cpu: str = Field(default="500m", description="CPU request of the server.")
    memory: str | None = Field(
        default=None, pattern=_QUANTITY,
        description="Memory request of the server. Unset: sized from a measurement of the server with `workers` "
        "(1Gi with 2).",
    )
    memory_limit: str | None = Field(
        default=None, pattern=_QUANTITY,
        description="Memory limit of the server. Unset: `memory` when that is set, else half as much again as "
        "the measured request (1536Mi with 2 workers).",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="More environment of the server (plain values, e.g. MLFLOW_SERVER_ENABLE_JOB_EXECUTION: "
        "'true' to run MLflow's server-side jobs, which needs about 1.5 GiB more memory). Secrets are refused.",
    )
    auth: MlflowAuthConfig = Field(
        default_factory=lambda: MlflowAuthConfig(), description="MLflow's basic authentication (off by default)."
    )
    postgres: PostgresConfig = Field(default_factory=lambda: PostgresConfig(), description="The backend store.")
    artifacts: ArtifactsConfig = Field(default_factory=lambda: ArtifactsConfig(), description="The artifact store.")

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            if not _ENV_NAME.match(name):
                raise ValueError(f"'{name}' is not a valid environment variable name")
            if _SECRET_NAME.search(name):
                raise ValueError(f"'{name}' looks like a secret: the server reads secrets only from Secrets")
        return value


class AlertsConfig(Section):
    hang_minutes: int = Field(
        default=15, ge=1, description="Alert when a job without a launcher (one process) finished no step for this "
        "long; under a launcher the job's own threshold applies (half its dist.hang_timeout_seconds).",
    )
    straggler_ratio: float = Field(
        default=1.5, gt=1,
        description="Alert when a rank's step time is this many times the median of the other ranks'.",
    )
    straggler_minutes: int = Field(default=10, ge=1, description="For how long a rank must straggle.")
    restart_window_minutes: int = Field(
        default=60, ge=1, description="Alert on a worker restart or a resumed pod within this window.",
    )
    checkpoint_lag_steps: int = Field(
        default=2000, ge=1, description="Alert when the newest checkpoint is more steps behind than this.",
    )
    upload_window_minutes: int = Field(
        default=60, ge=1, description="Alert while a checkpoint upload failed within this window.",
    )
    severity: str = Field(default="warning", min_length=1, description="The `severity` label of every alert.")


class MonitoringConfig(Section):
    enabled: bool = Field(default=True, description="Render the PodMonitor, alert rules and dashboard.")
    labels: dict[str, str] = Field(
        default_factory=lambda: {"release": "kube-prometheus-stack"},
        description="Labels your Prometheus selects PodMonitors and PrometheusRules by (kube-prometheus-stack: "
        "release: <its release name>).",
    )
    interval: str = Field(default="30s", pattern=r"^[0-9]+(ms|s|m|h)$", description="Scrape interval.")
    dashboard_namespace: str | None = Field(
        default=None, pattern=_DNS_LABEL,
        description="Namespace of the dashboard ConfigMap (default: the platform's; Grafana's sidecar must "
        "watch it).",
    )
    alerts: AlertsConfig = Field(default_factory=lambda: AlertsConfig(), description="Alert thresholds.")


class PlatformConfig(Section):
    name: str = Field(default="kubetrain", pattern=_DNS_LABEL, max_length=30, description="Prefix of every object.")
    namespace: str = Field(default="default", pattern=_DNS_LABEL, max_length=63, description="Where it runs.")
    labels: dict[str, str] = Field(default_factory=dict, description="Extra labels on every object.")
    mlflow: MlflowServerConfig = Field(
        default_factory=lambda: MlflowServerConfig(), description="The tracking server."
    )
    monitoring: MonitoringConfig = Field(
        default_factory=lambda: MonitoringConfig(), description="Prometheus Operator objects and Grafana."
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="When the kubelet pulls the images."
    )


def load_platform(path: Path | None, namespace: str | None = None) -> PlatformConfig:
    """The platform config from a YAML file (defaults without one); bad keys are one `error:` line."""
    raw = read_yaml(path) if path is not None else {}
    if namespace:
        raw["namespace"] = namespace
    try:
        return PlatformConfig.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
        raise ConfigError(f"{path or 'platform config'}: {where}: {msg}") from None

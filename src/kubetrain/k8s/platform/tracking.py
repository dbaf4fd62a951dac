"""The MLflow tracking server of a namespace, on PostgreSQL: the objects `kubetrain k8s platform` renders.

PostgreSQL is a StatefulSet with a claim, or an existing database named by postgres.uri; its password only
ever comes from a Secret the team creates (PGPASSWORD / POSTGRES_PASSWORD by secretKeyRef). MLflow proxies
artifacts (`--serve-artifacts`) to a claim or an object store, so training pods need no store credentials
of their own for them. Every pod is Pod Security "restricted"; NetworkPolicies admit only the namespace's
training pods to MLflow, and only MLflow to PostgreSQL. With mlflow.auth, the server runs MLflow's basic-auth
app; its admin password and Flask secret key come from a Secret the team creates.

MLflow 3.x's server also starts a job runner (huey) for its server-side jobs (GenAI scorers, trace rollups),
which training does not use and which takes about 1.4 GiB more: it is off (MLFLOW_SERVER_ENABLE_JOB_EXECUTION,
mlflow/environment_variables.py; `_run_server` in mlflow/server/__init__.py starts no runner without it) unless
mlflow.env turns it on.
"""

from __future__ import annotations

import math
from typing import Any

from kubetrain.k8s.platform.config import PlatformConfig
from kubetrain.k8s.render.objects import KEEP_CLAIM
from kubetrain.k8s.workloads import MANAGED_BY

DB_USER = "mlflow"
DB_NAME = "mlflow"
DB_PORT = 5432
ARTIFACTS_MOUNT = "/artifacts"
PGDATA_MOUNT = "/var/lib/postgresql/data"
# The pods the tracking server admits: every kubetrain training pod of the namespace (podspec.pod_metadata).
TRAINER_PODS = {"app.kubernetes.io/managed-by": MANAGED_BY, "app.kubernetes.io/component": "trainer"}
AUTH_MOUNT = "/etc/mlflow-auth"
AUTH_FILE = "basic_auth.ini"
# Measured (test_tracking.py measures it again): mlflow 3.17.2's `mlflow server`, job execution off, the sum of
# the RSS of its process tree once /health answers: the `mlflow server` process that waits on uvicorn 252 MiB,
# uvicorn's supervisor 26 MiB, multiprocessing's resource tracker 12 MiB, and about 250 MiB per worker (786 MiB
# with 2 workers; 601 MiB proportional set size). With job execution on it needs about 1.4 GiB more.
SERVER_MIB = 290
WORKER_MIB = 250
REQUEST_HEADROOM = 1.25  # the request: the measurement and a quarter more, for what a long-lived server grows by
LIMIT_FACTOR = 1.5  # the limit: half as much again as the request, before the kernel kills it


def _mib(value: float) -> str:
    return f"{math.ceil(value / 64) * 64}Mi"  # whole 64 MiB steps: 1024Mi reads as 1Gi does


def server_memory(cfg: PlatformConfig) -> tuple[str, str]:
    """(request, limit) of the MLflow container: the configured ones, or sized from the measurement above."""
    m = cfg.mlflow
    request = (SERVER_MIB + WORKER_MIB * m.workers) * REQUEST_HEADROOM
    return m.memory or _mib(request), m.memory_limit or m.memory or _mib(request * LIMIT_FACTOR)


def _labels(cfg: PlatformConfig, component: str) -> dict[str, str]:
    return {**cfg.labels, "app.kubernetes.io/name": "kubetrain", "app.kubernetes.io/part-of": "kubetrain-platform",
            "app.kubernetes.io/managed-by": MANAGED_BY, "app.kubernetes.io/component": component}


def _selector(cfg: PlatformConfig, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/part-of": "kubetrain-platform", "app.kubernetes.io/instance": cfg.name,
            "app.kubernetes.io/component": component}


def _meta(cfg: PlatformConfig, name: str, component: str) -> dict[str, Any]:
    return {"name": name, "namespace": cfg.namespace,
            "labels": {**_labels(cfg, component), "app.kubernetes.io/instance": cfg.name}}


def mlflow_name(cfg: PlatformConfig) -> str:
    return f"{cfg.name}-mlflow"


def postgres_name(cfg: PlatformConfig) -> str:
    return f"{cfg.name}-postgres"


def tracking_uri(cfg: PlatformConfig) -> str:
    """What a job's track.mlflow.tracking_uri names: the Service, by a name a NetworkPolicy can select."""
    return f"http://{mlflow_name(cfg)}.{cfg.namespace}:{cfg.mlflow.port}"


def backend_uri(cfg: PlatformConfig) -> str:
    pg = cfg.mlflow.postgres
    return pg.uri or f"postgresql://{DB_USER}@{postgres_name(cfg)}:{DB_PORT}/{DB_NAME}"


def _password(cfg: PlatformConfig, variable: str) -> dict[str, Any]:
    pg = cfg.mlflow.postgres
    return {"name": variable, "valueFrom": {"secretKeyRef": {"name": pg.secret_name, "key": pg.secret_key}}}


def _security(uid: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(pod, container) security contexts of the restricted profile, for an image's own non-root user."""
    pod = {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid, "fsGroup": uid,
           "seccompProfile": {"type": "RuntimeDefault"}}
    container = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
                 "capabilities": {"drop": ["ALL"]}}
    return pod, container


def allowed_hosts(cfg: PlatformConfig) -> str:
    """The Host headers MLflow's DNS-rebinding guard accepts: the Service's names, and the probes' loopback."""
    svc = mlflow_name(cfg)
    names = [svc, f"{svc}:*", f"{svc}.{cfg.namespace}", f"{svc}.{cfg.namespace}:*", f"{svc}.{cfg.namespace}.svc*",
             "localhost:*", "127.0.0.1:*"]
    return ",".join(names)


def server_args(cfg: PlatformConfig) -> list[str]:
    """`mlflow server ...` as the container runs it (the tests run the same arguments against a real database)."""
    m = cfg.mlflow
    artifacts = m.artifacts.uri or ARTIFACTS_MOUNT
    auth = ["--app-name", "basic-auth"] if m.auth.enabled else []
    return ["mlflow", "server", "--host", "0.0.0.0", "--port", str(m.port), "--workers", str(m.workers),
            "--backend-store-uri", backend_uri(cfg), "--serve-artifacts", "--artifacts-destination", artifacts,
            "--allowed-hosts", allowed_hosts(cfg), *auth]


def auth_ini(cfg: PlatformConfig) -> str:
    """MLflow's basic_auth.ini (mlflow/server/auth/config.py reads it from MLFLOW_AUTH_CONFIG_PATH): its users live
    in the backend database (their own tables and alembic_version_auth); no password is in it, the admin's comes
    from MLFLOW_AUTH_ADMIN_PASSWORD, which takes precedence over the file."""
    a = cfg.mlflow.auth
    return ("[mlflow]\n"
            f"default_permission = {a.default_permission}\n"
            f"database_uri = {backend_uri(cfg)}\n"
            f"admin_username = {a.admin_username}\n"
            "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n")


def server_env(cfg: PlatformConfig) -> list[dict[str, Any]]:
    """The container's environment: plain values and Secret references, then mlflow.env (which wins by name)."""
    m = cfg.mlflow
    env: list[dict[str, Any]] = [{"name": "HOME", "value": "/tmp"}, _password(cfg, "PGPASSWORD"),
                                 {"name": "MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "value": "false"}]
    if m.artifacts.endpoint_url:
        env.append({"name": "MLFLOW_S3_ENDPOINT_URL", "value": m.artifacts.endpoint_url})
    if m.artifacts.secret_name:
        env += [{"name": key, "valueFrom": {"secretKeyRef": {"name": m.artifacts.secret_name, "key": key}}}
                for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")]
    if m.auth.enabled:
        secret = m.auth.secret_name
        env += [{"name": "MLFLOW_AUTH_CONFIG_PATH", "value": f"{AUTH_MOUNT}/{AUTH_FILE}"},
                {"name": "MLFLOW_AUTH_ADMIN_PASSWORD",
                 "valueFrom": {"secretKeyRef": {"name": secret, "key": m.auth.password_key}}},
                {"name": "MLFLOW_FLASK_SERVER_SECRET_KEY",
                 "valueFrom": {"secretKeyRef": {"name": secret, "key": m.auth.flask_secret_key}}}]
    env = [e for e in env if e["name"] not in m.env]
    return env + [{"name": name, "value": value} for name, value in m.env.items()]


def mlflow_deployment(cfg: PlatformConfig) -> dict[str, Any]:
    m = cfg.mlflow
    pod_sc, container_sc = _security(m.run_as_user)
    health = {"httpGet": {"path": "/health", "port": "http"}}  # answers before the Host check
    mounts: list[dict[str, Any]] = [{"name": "tmp", "mountPath": "/tmp"}]
    volumes: list[dict[str, Any]] = [{"name": "tmp", "emptyDir": {}}]
    if not m.artifacts.uri:
        mounts.append({"name": "artifacts", "mountPath": ARTIFACTS_MOUNT})
        volumes.append({"name": "artifacts", "persistentVolumeClaim": {"claimName": f"{mlflow_name(cfg)}-artifacts"}})
    if m.auth.enabled:
        mounts.append({"name": "auth", "mountPath": AUTH_MOUNT, "readOnly": True})
        volumes.append({"name": "auth", "configMap": {"name": f"{mlflow_name(cfg)}-auth"}})
    request, limit = server_memory(cfg)
    container = {
        "name": "mlflow",
        "image": m.image,
        "imagePullPolicy": cfg.image_pull_policy,
        "command": server_args(cfg),
        "env": server_env(cfg),
        "ports": [{"name": "http", "containerPort": m.port, "protocol": "TCP"}],
        # the first start migrates the database's schema: give it minutes before liveness counts
        "startupProbe": {**health, "periodSeconds": 5, "failureThreshold": 60},
        "readinessProbe": {**health, "periodSeconds": 10, "failureThreshold": 3},
        "livenessProbe": {**health, "periodSeconds": 20, "failureThreshold": 6},
        "resources": {"requests": {"cpu": m.cpu, "memory": request}, "limits": {"memory": limit}},
        "securityContext": container_sc,
        "volumeMounts": mounts,
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(cfg, mlflow_name(cfg), "tracking"),
        # one replica on a ReadWriteOnce claim; Recreate so an update never needs two pods on it
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": _selector(cfg, "tracking")},
            "template": {
                "metadata": {"labels": {**_labels(cfg, "tracking"), **_selector(cfg, "tracking")}},
                "spec": {"automountServiceAccountToken": False, "securityContext": pod_sc,
                         "containers": [container], "volumes": volumes},
            },
        },
    }


def _service(cfg: PlatformConfig, name: str, component: str, port: int, port_name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(cfg, name, component),
            "spec": {"selector": _selector(cfg, component),
                     "ports": [{"name": port_name, "port": port, "targetPort": port_name, "protocol": "TCP"}]}}


def _claim(cfg: PlatformConfig, name: str, component: str, size: str, storage_class: str | None) -> dict[str, Any]:
    spec: dict[str, Any] = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": size}}}
    if storage_class:
        spec["storageClassName"] = storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": _meta(cfg, name, component),
            "spec": spec}


def postgres_statefulset(cfg: PlatformConfig) -> dict[str, Any]:
    pg = cfg.mlflow.postgres
    pod_sc, container_sc = _security(pg.uid)
    ready = {"exec": {"command": ["pg_isready", "-h", "127.0.0.1", "-p", str(DB_PORT), "-U", DB_USER, "-d", DB_NAME]}}
    container = {
        "name": "postgres",
        "image": pg.image,
        "imagePullPolicy": cfg.image_pull_policy,
        "env": [{"name": "POSTGRES_USER", "value": DB_USER}, {"name": "POSTGRES_DB", "value": DB_NAME},
                _password(cfg, "POSTGRES_PASSWORD"), {"name": "PGDATA", "value": f"{PGDATA_MOUNT}/pgdata"}],
        "ports": [{"name": "postgres", "containerPort": DB_PORT, "protocol": "TCP"}],
        "readinessProbe": {**ready, "periodSeconds": 10},
        "livenessProbe": {**ready, "periodSeconds": 30, "failureThreshold": 6, "initialDelaySeconds": 30},
        "resources": {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}},
        "securityContext": container_sc,
        # the root filesystem is read-only: the socket folder and /tmp are the only other places it writes
        "volumeMounts": [{"name": "data", "mountPath": PGDATA_MOUNT},
                         {"name": "run", "mountPath": "/var/run/postgresql"}, {"name": "tmp", "mountPath": "/tmp"}],
    }
    claim = _claim(cfg, "data", "database", pg.size, pg.storage_class)
    claim["metadata"] = {"name": "data", "labels": claim["metadata"]["labels"]}
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(cfg, postgres_name(cfg), "database"),
        "spec": {
            "serviceName": postgres_name(cfg),
            "replicas": 1,
            "selector": {"matchLabels": _selector(cfg, "database")},
            "template": {
                "metadata": {"labels": {**_labels(cfg, "database"), **_selector(cfg, "database")}},
                "spec": {"automountServiceAccountToken": False, "securityContext": pod_sc,
                         "containers": [container],
                         "volumes": [{"name": "run", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}]},
            },
            "volumeClaimTemplates": [claim],
        },
    }


def _policy(cfg: PlatformConfig, name: str, component: str, peers: dict[str, str], port: str) -> dict[str, Any]:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": _meta(cfg, name, component),
            "spec": {"podSelector": {"matchLabels": _selector(cfg, component)}, "policyTypes": ["Ingress"],
                     "ingress": [{"from": [{"podSelector": {"matchLabels": peers}}],
                                  "ports": [{"port": port, "protocol": "TCP"}]}]}}


def tracking_objects(cfg: PlatformConfig) -> list[dict[str, Any]]:
    """Database (unless postgres.uri names one), artifact claim, MLflow, their Services and NetworkPolicies."""
    m = cfg.mlflow
    out: list[dict[str, Any]] = []
    if not m.postgres.uri:
        out += [_service(cfg, postgres_name(cfg), "database", DB_PORT, "postgres"),
                _policy(cfg, postgres_name(cfg), "database", _selector(cfg, "tracking"), "postgres"),
                postgres_statefulset(cfg)]
    if not m.artifacts.uri:
        artifacts = _claim(cfg, f"{mlflow_name(cfg)}-artifacts", "tracking", m.artifacts.size,
                           m.artifacts.storage_class)
        artifacts["metadata"]["annotations"] = dict(KEEP_CLAIM)  # `helm uninstall` of the chart keeps the artifacts
        out.append(artifacts)
    if m.auth.enabled:
        out.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(cfg, f"{mlflow_name(cfg)}-auth",
                                                                                  "tracking"),
                    "data": {AUTH_FILE: auth_ini(cfg)}})
    out += [_service(cfg, mlflow_name(cfg), "tracking", m.port, "http"),
            _policy(cfg, mlflow_name(cfg), "tracking", TRAINER_PODS, "http"),
            mlflow_deployment(cfg)]
    return out

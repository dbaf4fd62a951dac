"""`kubetrain k8s platform render --format helm -o DIR`: the platform as a Helm chart (k8s/render/helm.py says how).

Two choices change which objects there are, so the chart holds both sides of each, picked by values: the
database (`mlflow.postgres.uri` empty: the PostgreSQL StatefulSet, its Service and NetworkPolicy; set: an
existing database by reference) and MLflow's basic auth (`mlflow.auth.enabled`): one template per object, the
lines that differ between the choices under `{{ if }}`. values-dev.yaml and
values-prod.yaml are the environments of ENVIRONMENTS, written in platform config keys and lifted like the rest.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubetrain.errors import UserInputError
from kubetrain.k8s.platform.config import PlatformConfig
from kubetrain.k8s.platform.render import render_platform
from kubetrain.k8s.render.helm import Value, Variant, lift
from kubetrain.k8s.render.helm_chart import write_chart
from kubetrain.k8s.render.job_chart import DNS_LABEL, DNS_SUBDOMAIN, QUANTITY

EXTERNAL_DB = "postgresql://mlflow@postgres.databases.svc:5432/mlflow"  # the external database's stand-in
URI_EXPR = ".Values.mlflow.postgres.uri"
AUTH_EXPR = ".Values.mlflow.auth.enabled"
# The environments, in platform config keys: dev keeps everything in the namespace and small; prod uses the team's
# own database, MLflow's basic auth, and larger claims.
ENVIRONMENTS: dict[str, dict[str, Any]] = {
    "dev": {"mlflow.cpu": "250m", "mlflow.artifacts.size": "5Gi", "mlflow.postgres.size": "5Gi"},
    "prod": {"mlflow.cpu": "1", "mlflow.artifacts.size": "200Gi", "mlflow.postgres.uri": EXTERNAL_DB,
             "mlflow.auth.enabled": True},
}
_QUANTITY = {"type": "string", "pattern": QUANTITY}
_SECRET = {"type": "string", "pattern": DNS_SUBDOMAIN, "maxLength": 253}


def with_settings(cfg: PlatformConfig, settings: dict[str, Any]) -> PlatformConfig:
    """The platform config with dotted keys set (mlflow.postgres.uri: ...), validated again."""
    raw = cfg.model_dump(mode="json")
    for key, value in settings.items():
        *parents, last = key.split(".")
        node = raw
        for part in parents:
            node = node[part]
        node[last] = value
    return PlatformConfig.model_validate(raw)


def _values(cfg: PlatformConfig) -> list[Value]:
    def setting(key: str) -> Callable[[Any], list[dict[str, Any]]]:
        return lambda value: render_platform(with_settings(cfg, {key: value}))

    def value(key: str, source: str, sentinel: Any, schema: dict[str, Any], expr: str = "") -> Value:
        default: Any = cfg.model_dump(mode="json")
        for part in source.split("."):
            default = default[part]
        return Value(key, default, sentinel, schema, setting(source), source, expr)

    m = cfg.mlflow
    out = [value("namespace", "namespace", "kthelm-namespace",
                 {"type": "string", "pattern": f"^$|{DNS_LABEL}", "maxLength": 63},
                 "(.Values.namespace | default .Release.Namespace)")]
    if m.enabled:
        out += [value("mlflow.image", "mlflow.image", "kthelm.invalid/mlflow:sentinel",
                      {"type": "string", "minLength": 1}),
                value("mlflow.cpu", "mlflow.cpu", "7331m", _QUANTITY),
                value("mlflow.postgres.secretName", "mlflow.postgres.secret_name", "kthelm-db-secret", _SECRET)]
        if m.postgres.uri:
            out.append(value("mlflow.postgres.uri", "mlflow.postgres.uri", "postgresql://kthelm@kthelm-db:5999/kthelm",
                             {"type": "string"}))
        else:
            out += [value("mlflow.postgres.image", "mlflow.postgres.image", "kthelm.invalid/postgres:sentinel",
                          {"type": "string", "minLength": 1}),
                    value("mlflow.postgres.size", "mlflow.postgres.size", "7331Gi", _QUANTITY)]
        if not m.artifacts.uri:
            out.append(value("mlflow.artifacts.size", "mlflow.artifacts.size", "7331Gi", _QUANTITY))
        if m.auth.enabled:
            out.append(value("mlflow.auth.secretName", "mlflow.auth.secret_name", "kthelm-auth-secret", _SECRET))
    if cfg.monitoring.enabled:
        out.append(value("monitoring.interval", "monitoring.interval", "7331s",
                         {"type": "string", "pattern": r"^[0-9]+(ms|s|m|h)$"}))
        if cfg.monitoring.dashboard_namespace:  # another namespace than the platform's: it must exist
            out.append(value("monitoring.dashboardNamespace", "monitoring.dashboard_namespace", "kthelm-dashboards",
                             {"type": "string", "pattern": DNS_LABEL, "maxLength": 63}))
    return out


def _variants(cfg: PlatformConfig, notes: list[str]) -> list[Variant]:
    """The platform both ways for each choice: own database or an external one, basic auth off or on."""
    if not cfg.mlflow.enabled:
        choices: list[tuple[tuple[str, Any], ...]] = [()]
    else:
        database = (("mlflow.postgres.uri", None), ("mlflow.postgres.uri", cfg.mlflow.postgres.uri or EXTERNAL_DB))
        auth = (("mlflow.auth.enabled", False), ("mlflow.auth.enabled", True))
        choices = list(itertools.product(database, auth))
    out = []
    for choice in choices:
        variant_cfg = with_settings(cfg, dict(choice))
        tests = [f"(not {URI_EXPR})" if k.endswith("uri") and v is None else URI_EXPR if k.endswith("uri")
                 else AUTH_EXPR if v else f"(not {AUTH_EXPR})" for k, v in choice]
        condition = " ".join(["and", *tests]) if tests else ""
        variant = Variant(condition, render_platform(variant_cfg), _values(variant_cfg), tuple(tests))
        lift(variant, notes)
        out.append(variant)
    return out


def platform_chart(cfg: PlatformConfig, folder: Path) -> tuple[list[Path], list[str]]:
    """Write the platform's chart, with values-dev.yaml and values-prod.yaml. Returns (files, notes)."""
    notes: list[str] = []
    variants = _variants(cfg, notes)
    lifted = {v.key: v for variant in variants for v in variant.lifted}
    choices = []
    if cfg.mlflow.enabled:
        choices = [Value("mlflow.postgres.uri", cfg.mlflow.postgres.uri or "", None,
                         {"type": "string", "pattern": r"^$|^postgresql(\+psycopg2?|\+psycopg)?://[^:@/]+@[^@]+$"},
                         lambda _: [], "mlflow.postgres.uri"),
                   Value("mlflow.auth.enabled", cfg.mlflow.auth.enabled, None, {"type": "boolean"}, lambda _: [],
                         "mlflow.auth.enabled")]
        for choice in choices:  # its default is the config's, not the stand-in a variant rendered with
            lifted.pop(choice.key, None)
        variants[0].lifted = [*variants[0].lifted, *choices]
        for variant in variants[1:]:
            variant.lifted = [v for v in variant.lifted if v.key not in {c.key for c in choices}]
    by_source = {v.source: v.key for v in [*lifted.values(), *choices]}
    environments = {}
    for env, settings in ENVIRONMENTS.items():
        tree: dict[str, Any] = {}
        for source, setting in settings.items():
            if source not in by_source:
                raise UserInputError(f"values-{env}.yaml: {source} is not a value of this chart")
            *parents, last = by_source[source].split(".")
            node = tree
            for part in parents:
                node = node.setdefault(part, {})
            node[last] = copy.deepcopy(setting)
        environments[env] = tree
    notes_txt = ("kubetrain platform {{ .Release.Name }} in {{ .Values.namespace | default .Release.Namespace }}.\n"
                 "Jobs log to MLflow with track.mlflow.tracking_uri: http://" + f"{cfg.name}-mlflow." +
                 "{{ .Values.namespace | default .Release.Namespace }}:" + f"{cfg.mlflow.port}\n")
    if cfg.monitoring.enabled and cfg.monitoring.dashboard_namespace:
        notes_txt += ("The Grafana dashboard is the ConfigMap " + f"{cfg.name}-dashboard" + " in namespace "
                      "{{ .Values.monitoring.dashboardNamespace }} (which the install needed to exist; Grafana's "
                      "sidecar must watch it).\n")
    files = write_chart(folder, name=f"{cfg.name}-platform", description="kubetrain's platform of one namespace: "
                        "MLflow on PostgreSQL, PodMonitor, alert rules, the Grafana dashboard",
                        variants=variants, notes_txt=notes_txt, environments=environments)
    return files, notes

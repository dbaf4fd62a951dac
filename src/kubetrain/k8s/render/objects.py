"""Objects every job has besides its workload: the config as a ConfigMap, claims, NetworkPolicy, Service."""

from __future__ import annotations

from typing import Any

import yaml

from kubetrain.config.loading import validate as validate_config
from kubetrain.config.schema import Config
from kubetrain.k8s.render.context import CONFIG_FILE, RenderContext, RenderError
from kubetrain.k8s.render.podspec import image
from kubetrain.secrets import redact, redact_text


def pod_config(ctx: RenderContext) -> Config:
    """The config the pods train with: the same one, with run.output_dir on the checkpoint volume, k8s.image the
    one they run, and the checkpoint grace a measured slow save asks for (the loop's stop watchdog must not give
    up mid-save)."""
    raw = ctx.cfg.model_dump(mode="json")
    raw["run"]["output_dir"] = ctx.checkpoint_mount
    raw["k8s"]["image"] = image(ctx.k)  # the image the pods run (a GPU pod's default is the -cuda build)
    if ctx.checkpoint_grace != ctx.cfg.checkpoint.grace_seconds:
        raw["checkpoint"]["grace_seconds"] = ctx.checkpoint_grace
    if ctx.k.metrics.enabled:
        _enable_exporter(raw, ctx.k.metrics.port)
    return validate_config(raw, source="pod config")


def _enable_exporter(raw: dict[str, Any], port: int) -> None:
    """Serve rank 0's /metrics and /healthz on the port the probe and the NetworkPolicy expect."""
    from kubetrain.config.track import TrackConfig

    prometheus = TrackConfig.model_fields.get("prometheus")
    if prometheus is None:  # this kubetrain has no exporter: the probe then finds nothing and passes
        return
    section = raw["track"].get("prometheus") or {}
    raw["track"]["prometheus"] = {**section, "enabled": True, "port": port}


def _secret_paths(value: Any, clean: Any, path: str = "") -> list[str]:
    if isinstance(value, dict):
        return [
            p for k, v in value.items() for p in _secret_paths(v, clean.get(k), f"{path}.{k}".lstrip("."))
        ]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _secret_paths(v, clean[i], f"{path}.{i}")]
    return [path] if value != clean else []


def leaked_secrets(raw: dict[str, Any]) -> list[str]:
    """Keys of the config whose value looks like a secret (by key name or value shape).

    The k8s section names Secrets and image pull secrets without holding any, so there only values count.
    """
    rest = {k: v for k, v in raw.items() if k != "k8s"}
    k8s = raw.get("k8s") or {}
    return _secret_paths(rest, redact(rest)) + _secret_paths(k8s, _redact_values(k8s), "k8s")


def _redact_values(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _redact_values(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact_values(v) for v in value]
    return redact_text(value) if isinstance(value, str) else value


def config_map(ctx: RenderContext) -> dict[str, Any]:
    raw = pod_config(ctx).model_dump(mode="json")
    leaked = leaked_secrets(raw)
    if leaked:
        raise RenderError(
            f"the config holds what looks like a secret at '{leaked[0]}'; it would be stored in a ConfigMap. "
            "Pass it as an environment variable from a Secret (k8s.secrets.env) instead"
        )
    text = yaml.safe_dump(raw, sort_keys=False)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": ctx.meta(ctx.config_map),
        "data": {CONFIG_FILE: text},
    }


# `helm uninstall` of a chart (--format helm) keeps the claim too, as `stop` does
KEEP_CLAIM = {"helm.sh/resource-policy": "keep"}


def claims(ctx: RenderContext) -> list[dict[str, Any]]:
    """The PersistentVolumeClaims kubetrain creates; `stop` keeps them, so checkpoints outlive the job."""
    out = []
    for v in ctx.volumes:
        if not v.created:
            continue
        spec: dict[str, Any] = {
            "accessModes": [v.access_mode],
            "resources": {"requests": {"storage": v.spec.size}},
        }
        if v.spec.storage_class:
            spec["storageClassName"] = v.spec.storage_class
        meta = ctx.meta(v.claim)
        meta["annotations"] = dict(KEEP_CLAIM)
        out.append({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta, "spec": spec})
    return out


def headless_service(ctx: RenderContext) -> dict[str, Any]:
    """Stable DNS names for the pods (<pod-hostname>.<service>), published before the pods are ready, since
    the rendezvous happens before anything is ready."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": ctx.meta(ctx.name),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": ctx.selector,
            "ports": [
                {"name": "rdzv", "port": ctx.k.rdzv_port, "targetPort": ctx.k.rdzv_port, "protocol": "TCP"}
            ],
        },
    }

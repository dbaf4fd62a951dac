"""Every object of the platform, in apply order, and putting them on a cluster the way `launch` does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kubetrain.errors import UserInputError
from kubetrain.k8s.platform.config import PlatformConfig
from kubetrain.k8s.platform.monitoring import monitoring_objects
from kubetrain.k8s.platform.tracking import tracking_objects

Log = Callable[[str], None]


def render_platform(cfg: PlatformConfig) -> list[dict[str, Any]]:
    """The tracking server's objects, then the monitoring ones (either can be switched off)."""
    objects = tracking_objects(cfg) if cfg.mlflow.enabled else []
    objects += monitoring_objects(cfg) if cfg.monitoring.enabled else []
    if not objects:
        raise UserInputError("the platform config turns off both mlflow and monitoring: nothing to render")
    return objects


def require_operator(cluster: Any, objects: list[dict[str, Any]]) -> None:
    """A cluster without the Prometheus Operator's CRDs is refused before anything is sent."""
    from kubetrain.k8s.cluster.api_errors import ClusterError
    from kubetrain.k8s.cluster.resources import CUSTOM_KINDS

    for kind in sorted({o["kind"] for o in objects if o["kind"] in CUSTOM_KINDS}):
        if not cluster.served(kind):
            raise ClusterError(f"{cluster.where} does not serve {kind}: install {CUSTOM_KINDS[kind]}, or set "
                               "monitoring.enabled: false in the platform config")


def apply_platform(cluster: Any, objects: list[dict[str, Any]], *, dry_run: bool = False,
                   log: Log = print) -> None:
    """The API server validates every object in a dry run first; then all are applied (server-side apply)."""
    require_operator(cluster, objects)
    for obj in objects:
        cluster.apply(obj, dry_run=True)
    if dry_run:
        log(f"dry run: the API server accepted all {len(objects)} objects; nothing was stored")
        return
    for obj in objects:
        created = cluster.apply(obj)[1]
        log(f"{obj['kind'].lower()}/{obj['metadata']['name']} {'created' if created else 'applied'}")

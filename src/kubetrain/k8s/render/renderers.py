"""One small renderer per workload kind; each returns the workload (and its Service, if it needs one)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kubetrain.k8s.render import indexed_job, jobset, pytorchjob, statefulset, trainjob
from kubetrain.k8s.render.context import RenderContext

Renderer = Callable[[RenderContext], list[dict[str, Any]]]

RENDERERS: dict[str, Renderer] = {
    "indexed-job": indexed_job.render,
    "jobset": jobset.render,
    "trainjob": trainjob.render,
    "pytorchjob": pytorchjob.render,
    "statefulset": statefulset.render,
}

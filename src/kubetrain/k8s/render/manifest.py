"""Render a config into Kubernetes objects, in apply order: ConfigMap, claims, NetworkPolicy, the workload.

One renderer per workload lives beside this module; they all share the pod template of podspec.py and the
common objects of objects.py.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from kubetrain.config.schema import Config
from kubetrain.k8s.render.context import context
from kubetrain.k8s.render.grace import MeasuredSave
from kubetrain.k8s.render.memory import check_pod_memory
from kubetrain.k8s.render.network import network_policy
from kubetrain.k8s.render.objects import claims, config_map
from kubetrain.k8s.render.podsecurity import level_note
from kubetrain.k8s.render.renderers import RENDERERS
from kubetrain.k8s.render.spec_hash import pod_templates


def render(cfg: Config, workload: str | None = None, measured: MeasuredSave | None = None, *,
           memory_check: bool = True) -> list[dict[str, Any]]:
    """Every object of the job, in the order they are applied (the workload last).

    The same config (and `measured` save, see grace.py) renders the same objects, byte for byte. The memory
    check changes no object, only whether there are any: the Helm chart's probes (helm.py) go without it.
    """
    ctx = context(cfg, workload, measured)
    if memory_check:
        check_pod_memory(cfg)
    objects = [config_map(ctx), *claims(ctx)]
    if ctx.k.network_policy.enabled:
        objects.append(network_policy(ctx))
    objects.extend(RENDERERS[ctx.workload](ctx))
    stamp(objects)
    return objects


def pod_security_note(objects: list[dict[str, Any]]) -> str | None:
    """One line when an opt-in (k8s.ipc_lock, k8s.host_network) leaves the pods short of Pod Security 'restricted'."""
    return level_note([template["spec"] for obj in objects for _, template in pod_templates(obj)])


def stamp(objects: list[dict[str, Any]]) -> None:
    """Put a hash of everything rendered on the workload and its pod templates (spec_hash.py defines it).

    The same hash on the cluster means an unchanged relaunch (launch then does nothing); a different one
    changes the pod template, which a running Job refuses (immutable) instead of running on with an old
    config while the ConfigMap holds a new one.
    """
    from kubetrain.k8s.render.spec_hash import stamp as put_hash

    put_hash(objects)


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the config inside the ConfigMap) as readable `|` blocks."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def to_yaml(objects: list[dict[str, Any]]) -> str:
    return yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, default_flow_style=False)


def write_files(objects: list[dict[str, Any]], folder: Path) -> list[Path]:
    """One file per object, numbered in apply order: 00-configmap-NAME.yaml, ..."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, obj in enumerate(objects):
        slug = re.sub(r"[^a-z0-9-]+", "-", f"{obj['kind'].lower()}-{obj['metadata']['name']}")
        path = folder / f"{i:02d}-{slug}.yaml"
        path.write_text(to_yaml([obj]), encoding="utf-8")
        paths.append(path)
    return paths

"""`k8s render -o DIR`: one file per object plus a kustomization.yaml, for a repository that Argo CD or Flux applies.

`kubectl kustomize DIR` gives back exactly the objects `launch` applies (tests/k8s/platform/test_gitops.py runs
the real kubectl): `sortOptions: fifo` keeps kubetrain's apply order (ConfigMap, claims, NetworkPolicy, the
workload last) instead of kustomize's kind order. The one thing launch adds on the cluster is the owner
reference from the ConfigMap, Service and NetworkPolicy to the workload (its uid exists only there); under
GitOps the controller prunes them instead. Overlays (another namespace, image, resources) live in folders of
their own that name DIR as a resource, so a second render never overwrites them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kubetrain.errors import UserInputError
from kubetrain.k8s.render.manifest import write_files

KUSTOMIZATION = "kustomization.yaml"
_HEADER = "# Written by `kubetrain k8s render -o`; rendered again, it is replaced. Patch it from an overlay.\n"


def kustomization(files: list[str]) -> dict[str, Any]:
    """The kustomization that lists the files in apply order."""
    return {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": files,
        "sortOptions": {"order": "fifo"},
    }


def _previous(folder: Path) -> list[str]:
    """The files an earlier render listed; a kustomization.yaml of someone else's stops the render."""
    path = folder / KUSTOMIZATION
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8")
    if not text.startswith(_HEADER):
        raise UserInputError(f"{path} was not written by kubetrain; render into an empty folder (or one kubetrain "
                             "rendered before) and keep overlays in folders of their own")
    return list((yaml.safe_load(text) or {}).get("resources") or [])


def write_tree(objects: list[dict[str, Any]], folder: Path) -> list[Path]:
    """Write the objects and their kustomization.yaml; files an earlier render listed and this one does not go."""
    if folder.exists() and not folder.is_dir():
        raise UserInputError(f"-o {folder}: that is a file; name a folder (render writes one file per object "
                             f"and a {KUSTOMIZATION} into it)")
    old = _previous(folder)
    paths = write_files(objects, folder)
    names = [p.name for p in paths]
    for name in old:
        if name not in names and "/" not in name:
            (folder / name).unlink(missing_ok=True)  # a claim or policy the config no longer renders
    path = folder / KUSTOMIZATION
    path.write_text(_HEADER + yaml.safe_dump(kustomization(names), sort_keys=False), encoding="utf-8")
    return [*paths, path]

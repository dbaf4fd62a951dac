"""A job's Kubernetes objects on the command line: rendered from a config, validated, printed or written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from kubetrain.cli.k8s_options import checked_workload
from kubetrain.cli.options import load


def rendered(config: Path | None, preset: str | None, set_: list[str] | None, workload: str | None,
             namespace: str | None) -> list[dict[str, Any]]:
    """The job's objects from a config, with the notes a reader of the manifest needs on stderr."""
    from kubetrain.k8s.render.grace import measured_locally, render_note
    from kubetrain.k8s.render.manifest import pod_security_note, render

    overrides = list(set_ or [])
    if namespace:
        overrides.append(f"k8s.namespace={namespace}")
    cfg = load(config, preset, overrides)
    measured = measured_locally(cfg)  # a local or fetched run's save time lengthens the grace period
    objects = render(cfg, checked_workload(workload), measured)
    # RDMA opt-ins leave "restricted": say which level the pods meet; a measured save: why the grace changed
    for note in (pod_security_note(objects), render_note(cfg, measured)):
        if note:
            typer.echo(note, err=True)
    return objects


def validate_objects(objects: list[dict[str, Any]], schemas: Any) -> None:
    """Strict schema validation; one line on stderr for custom resources no CRD schema was given for."""
    from kubetrain.k8s.render import validate

    validate.check(objects, schemas)
    kinds = validate.unchecked(objects, schemas)
    if kinds:
        typer.echo(f"note: {', '.join(kinds)} rendered without a CRD schema check (give --crds DIR or "
                   f"{validate.CRD_DIR_ENV}; launch checks against the cluster's CRD)", err=True)


def print_or_write(objects: list[dict[str, Any]], output: Path | None) -> None:
    """YAML on stdout, or one file per object plus a kustomization.yaml in `output` (their paths printed)."""
    from kubetrain.k8s.platform.gitops import write_tree
    from kubetrain.k8s.render.manifest import to_yaml

    if output is None:
        typer.echo(to_yaml(objects), nl=False)
        return
    for path in write_tree(objects, output):
        typer.echo(str(path))

"""`kubetrain k8s render|launch|status|logs|stop|list|shell|doctor|simulate|entrypoint`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kubetrain.cli.options import ConfigArg, PresetOpt, SetOpt, load
from kubetrain.config.k8s import WORKLOADS
from kubetrain.errors import UserInputError

app = typer.Typer(help="Render, launch and manage training jobs on Kubernetes.", no_args_is_help=True)

WorkloadOpt = Annotated[
    str | None,
    typer.Option("--workload", "-w", help=f"Override k8s.workload: {', '.join(WORKLOADS)}.",
                 show_default=False),
]
KubeconfigOpt = Annotated[
    Path | None,
    typer.Option("--kubeconfig", help="Kubeconfig file (default: $KUBECONFIG, ~/.kube/config, in-cluster)."),
]
ContextOpt = Annotated[str | None, typer.Option("--context", help="Kubeconfig context (default: current).")]
NamespaceOpt = Annotated[
    str | None,
    typer.Option("--namespace", "-n", help="Namespace (default: k8s.namespace, else the context's)."),
]
NoValidateOpt = Annotated[bool, typer.Option("--no-validate", help="Skip the offline schema validation.")]


def _workload(name: str | None) -> str | None:
    if name is not None and name not in WORKLOADS:
        raise UserInputError(f"--workload: unknown workload '{name}'; choose one of {', '.join(WORKLOADS)}")
    return name


def _rendered(config: Path | None, preset: str | None, set_: list[str] | None, workload: str | None,
              namespace: str | None, validate: bool) -> list[dict[str, object]]:
    from kubetrain.k8s import validate as checks
    from kubetrain.k8s.render import render

    overrides = list(set_ or [])
    if namespace:
        overrides.append(f"k8s.namespace={namespace}")
    objects = render(load(config, preset, overrides), _workload(workload))
    if validate:
        checks.check(objects)
    return objects


@app.command()
def render(
    config: ConfigArg = None,
    preset: PresetOpt = None,
    set_: SetOpt = None,
    workload: WorkloadOpt = None,
    namespace: NamespaceOpt = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write one file per object into "
                                                "this folder instead of printing.")] = None,
    no_validate: NoValidateOpt = False,
) -> None:
    """Print the job's Kubernetes objects as YAML, validated strictly against their schemas."""
    from kubetrain.k8s.render import to_yaml, write_files

    objects = _rendered(config, preset, set_, workload, namespace, not no_validate)
    if output is None:
        typer.echo(to_yaml(objects), nl=False)
        return
    for path in write_files(objects, output):
        typer.echo(str(path))

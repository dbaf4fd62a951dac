"""`--format helm` of `k8s render` and `k8s platform render`: the option, and what is printed for a chart."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from kubetrain.errors import UserInputError


class Format(StrEnum):
    yaml = "yaml"
    helm = "helm"


FormatOpt = Annotated[Format, typer.Option(
    "--format", help="yaml: the objects (one file each and a kustomization.yaml with -o); helm: a Helm chart in -o "
    "DIR whose default values render the same objects.")]


def require_folder(fmt: Format, output: Path | None) -> None:
    if fmt is Format.helm and output is None:
        raise UserInputError("--format helm writes a chart into a folder: give -o DIR")


def chart_written(files: list[Path], notes: list[str]) -> None:
    """The chart's paths on stdout; what stays fixed in it (and why) on stderr."""
    for note in notes:
        typer.echo(f"note: {note}", err=True)
    for path in files:
        typer.echo(str(path))


def write_job_chart(cfg: Any, objects: list[dict[str, Any]], output: Path, workload: str | None) -> None:
    """The job's chart in `output`, from the objects `k8s render` rendered for `cfg`."""
    from kubetrain.k8s.render.grace import measured_locally
    from kubetrain.k8s.render.job_chart import job_chart

    chart_written(*job_chart(cfg, objects, output, workload, measured_locally(cfg)))

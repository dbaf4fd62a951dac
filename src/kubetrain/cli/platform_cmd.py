"""`kubetrain k8s platform render|apply|explain`: the platform around the jobs (k8s/platform), one per namespace."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kubetrain.cli.helm_format import Format, FormatOpt, chart_written, require_folder
from kubetrain.cli.k8s_objects import print_or_write, validate_objects
from kubetrain.cli.k8s_options import (
    ContextOpt,
    CrdsOpt,
    DryRunOpt,
    KubeconfigOpt,
    NamespaceOpt,
    NoValidateOpt,
    cluster_for,
)
from kubetrain.errors import UserInputError

app = typer.Typer(help="The platform around the jobs: MLflow on PostgreSQL, PodMonitor, alert rules and "
                           "the Grafana dashboard, once per namespace.", no_args_is_help=True)
PlatformArg = Annotated[
    Path | None,
    typer.Argument(help="Platform config YAML (see deploy/platform/platform.yaml; default: every default).",
                   show_default=False),
]


@app.command("render")
def platform_render(
    config: PlatformArg = None,
    namespace: NamespaceOpt = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write one file per object and a "
                                                "kustomization.yaml into this folder instead of printing.")] = None,
    no_validate: NoValidateOpt = False,
    crds: CrdsOpt = None,
    fmt: FormatOpt = Format.yaml,
) -> None:
    """Print the platform's objects as YAML, validated strictly (PodMonitor and PrometheusRule with --crds).

    --format helm -o DIR writes a chart with values-dev.yaml and values-prod.yaml; its own database or an
    external one (mlflow.postgres.uri) and basic auth (mlflow.auth.enabled) are values there.
    """
    from kubetrain.k8s.platform.config import load_platform
    from kubetrain.k8s.platform.render import render_platform
    from kubetrain.k8s.platform.tracking import tracking_uri
    from kubetrain.k8s.render.validate import offline_schemas

    require_folder(fmt, output)
    cfg = load_platform(config, namespace)
    objects = render_platform(cfg)
    if not no_validate:
        validate_objects(objects, offline_schemas(crds))
    if fmt is Format.helm and output is not None:
        from kubetrain.k8s.platform.chart import platform_chart

        chart_written(*platform_chart(cfg, output))
    else:
        print_or_write(objects, output)
    if cfg.mlflow.enabled:
        typer.echo(f"jobs log to it with track.mlflow.tracking_uri: {tracking_uri(cfg)}", err=True)


@app.command("apply")
def platform_apply(
    config: PlatformArg = None,
    namespace: NamespaceOpt = None,
    kubeconfig: KubeconfigOpt = None,
    context: ContextOpt = None,
    crds: CrdsOpt = None,
    dry_run: DryRunOpt = False,
) -> None:
    """Apply the platform's objects, after the API server accepted all of them in a dry run.

    The database password is never rendered: create the Secret (postgres.secret_name) first.
    """
    from kubetrain.k8s.cluster.launch import cr_schemas
    from kubetrain.k8s.platform.config import load_platform
    from kubetrain.k8s.platform.render import apply_platform, render_platform, require_operator
    from kubetrain.k8s.platform.tracking import tracking_uri

    cfg = load_platform(config, namespace)
    objects = render_platform(cfg)
    cluster = cluster_for(kubeconfig, context)
    require_operator(cluster, objects)
    validate_objects(objects, cr_schemas(cluster, objects, crds))
    apply_platform(cluster, objects, dry_run=dry_run, log=typer.echo)
    if cfg.mlflow.enabled and not dry_run:
        typer.echo(f"jobs log to it with track.mlflow.tracking_uri: {tracking_uri(cfg)}")


@app.command("explain")
def platform_explain(
    key: Annotated[str | None, typer.Argument(help="A key (mlflow.postgres) or nothing for all.")] = None,
) -> None:
    """Every key of the platform config with its type, default and meaning (as `config explain` does)."""
    from kubetrain.config.explain import field_docs
    from kubetrain.config.explain import render as render_docs
    from kubetrain.k8s.platform.config import PlatformConfig

    docs = [d for d in field_docs(PlatformConfig) if not key or d.key == key or d.key.startswith(key + ".")]
    if not docs:
        raise UserInputError(f"unknown platform config key '{key}'; `kubetrain k8s platform explain` lists them")
    typer.echo(render_docs(docs))


@app.command("grant")
def platform_grant(
    tracking_uri: Annotated[str, typer.Option("--tracking-uri", help="The MLflow server, as you reach it (e.g. "
                                              "http://localhost:5000 through kubectl port-forward).")],
    user: Annotated[str, typer.Option("--user", help="The jobs' MLflow user (the username in their Secret).")],
    experiment: Annotated[str, typer.Option("--experiment", help="The jobs' track.mlflow.experiment.")] = "kubetrain",
    password_env: Annotated[str | None, typer.Option(
        "--password-env", help="Create the user first, with the password in this environment variable (the value "
        "of the jobs' Secret; never on the command line).")] = None,
) -> None:
    """Let a job's own MLflow user write to its experiment (mlflow.auth): an EDIT grant, made as the admin.

    Run with the admin's credentials in MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD. Creates the
    experiment when it is missing (and the user with --password-env); running it again changes nothing.
    """
    import os

    from kubetrain.k8s.platform.grants import grant_edit

    password = None
    if password_env is not None:
        password = os.environ.get(password_env)
        if not password:
            raise UserInputError(f"--password-env {password_env}: that environment variable is not set or empty")
    grant_edit(tracking_uri, user, experiment, password, say=typer.echo)

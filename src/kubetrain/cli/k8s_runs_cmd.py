"""`kubetrain k8s fetch|backup`: a job's run directory, copied from its claim to a local folder or object storage."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kubetrain.cli.k8s_options import ContextOpt, KubeconfigOpt, NamespaceOpt, cluster_for
from kubetrain.cli.options import SetOpt, load


def fetch(
    name: Annotated[str, typer.Argument(help="Job name.")],
    config: Annotated[Path | None, typer.Argument(help="The config the job was launched with; needed only "
                                                  "once the job is gone (its ConfigMap goes with it).")] = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Local folder (default: "
                                                "runs/<run.name>, where `kubetrain runs list` looks).")] = None,
    checkpoints: Annotated[str, typer.Option("--checkpoints", help="Which checkpoints: latest, best, all, "
                                             "none.")] = "latest",
    set_: SetOpt = None,
    namespace: NamespaceOpt = None,
    kubeconfig: KubeconfigOpt = None,
    context: ContextOpt = None,
) -> None:
    """Copy a launched job's run directory from its claim to a local folder, running or finished.

    Through a running pod of the job (exec), or a short-lived pod that mounts the claim read-only (deleted
    afterwards). Only what changed since the last fetch is copied; checkpoints are verified against their
    checksums and appear whole or not at all. With MLflow on its default SQLite store, the store and this run's
    artifacts land in DIR/mlflow/ (`mlflow ui --backend-store-uri sqlite:///DIR/mlflow/mlflow.db`). The folder
    works with `runs`, `generate`, `export` and `mlflow ui`.
    """
    from kubetrain.k8s.fetch.pods import fetch_job

    cluster = cluster_for(kubeconfig, context)
    ns = namespace or cluster.default_namespace
    given = load(config, None, set_) if config else None
    local, result = fetch_job(cluster, name, ns, output, checkpoints, given, log=typer.echo)
    copied = f"{len(result.copied)} files ({result.nbytes / 2**20:.1f} MiB)"
    verified = f", checkpoints verified: {', '.join(Path(c).name for c in result.checkpoints)}" \
        if result.checkpoints else ""
    for line in result.warnings:
        typer.echo(line, err=True)
    if result.mlflow_store is not None:
        runs = ", ".join(result.mlflow_runs) or "none of this run"
        typer.echo(f"MLflow runs {runs}: mlflow ui --backend-store-uri sqlite:///{result.mlflow_store.resolve()}")
    typer.echo(f"{local}: {copied} copied, {result.unchanged} unchanged{verified}")
    if result.failed:
        typer.echo("checkpoints that failed their checksums after the copy (not kept): " + "; ".join(result.failed),
                   err=True)
        raise typer.Exit(1)


def backup(
    name: Annotated[str, typer.Argument(help="Job name.")],
    uri: Annotated[str, typer.Argument(help="Object store root (s3://bucket/prefix, gs://..., az://...); the run "
                                      "goes to URI/<run.name>.")],
    config: Annotated[Path | None, typer.Argument(help="The config the job was launched with; needed only "
                                                  "once the job is gone (its ConfigMap goes with it).")] = None,
    via: Annotated[Path | None, typer.Option("--via", help="Local folder the run passes through, kept for the "
                                             "next backup (default: runs/<run.name>, as fetch).")] = None,
    checkpoints: Annotated[str, typer.Option("--checkpoints", help="Which checkpoints: all, latest, best, "
                                             "none.")] = "all",
    endpoint_url: Annotated[str | None, typer.Option("--endpoint-url", help="S3-compatible endpoint (default: "
                                                     "the job's checkpoint.endpoint_url).")] = None,
    set_: SetOpt = None,
    namespace: NamespaceOpt = None,
    kubeconfig: KubeconfigOpt = None,
    context: ContextOpt = None,
) -> None:
    """Copy a job's run directory from its claim to object storage: `k8s fetch` (verified), then `runs sync`.

    Running or finished, only what changed on each leg; nothing in the store is deleted. Restore anywhere with
    `kubetrain runs sync URI/<run.name> DIR`. Store credentials come from this shell's environment.
    """
    from kubetrain.k8s.platform.backup import backup_job

    cluster = cluster_for(kubeconfig, context)
    ns = namespace or cluster.default_namespace
    given = load(config, None, set_) if config else None
    result = backup_job(cluster, name, ns, uri, via=via, checkpoints=checkpoints, endpoint_url=endpoint_url,
                        given=given, log=typer.echo)
    for line in result.fetched.warnings:
        typer.echo(line, err=True)
    pushed = result.pushed
    verified = ", ".join(Path(c).name for c in result.fetched.checkpoints) or "none new"
    typer.echo(f"{result.destination}: {len(pushed.copied)} files ({pushed.nbytes / 2**20:.1f} MiB) pushed, "
               f"{pushed.unchanged} unchanged; checkpoints verified on the way: {verified}")
    if result.fetched.failed:
        typer.echo("checkpoints that failed their checksums (not backed up): " + "; ".join(result.fetched.failed),
                   err=True)
        raise typer.Exit(1)

"""`kubetrain k8s render|launch|status|logs|stop|list|shell|fetch|doctor|simulate|entrypoint|backup`: the group,
its commands in the order `--help` lists them."""

from __future__ import annotations

import typer

from kubetrain.cli import k8s_jobs_cmd, k8s_launch_cmd, k8s_pod_cmd, k8s_runs_cmd

app = typer.Typer(help="Render, launch and manage training jobs on Kubernetes, and fetch their runs back.",
                  no_args_is_help=True)
app.command()(k8s_launch_cmd.render)
app.command()(k8s_launch_cmd.launch)
app.command()(k8s_jobs_cmd.status)
app.command()(k8s_jobs_cmd.logs)
app.command()(k8s_jobs_cmd.stop)
app.command("list")(k8s_jobs_cmd.list_)
app.command()(k8s_jobs_cmd.shell)
app.command()(k8s_runs_cmd.fetch)
app.command()(k8s_launch_cmd.doctor)
app.command()(k8s_pod_cmd.simulate)
app.command()(k8s_pod_cmd.entrypoint)
app.command()(k8s_runs_cmd.backup)

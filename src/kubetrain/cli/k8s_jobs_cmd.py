"""`kubetrain k8s status|logs|stop|list|shell`: the jobs launched, by name."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from kubetrain.cli.k8s_options import ContextOpt, KubeconfigOpt, NamespaceOpt, cluster_for
from kubetrain.cli.options import JsonOpt
from kubetrain.errors import UserInputError


def status(
    name: Annotated[str, typer.Argument(help="Job name (k8s.name, or run.name).")],
    namespace: NamespaceOpt = None,
    kubeconfig: KubeconfigOpt = None,
    context: ContextOpt = None,
    json_: JsonOpt = False,
) -> None:
    """The job's state, progress (step/max, %, tokens/s, ETA), slowest rank, last incident, one line per rank.

    Progress and the last incident are read from the last 1000 lines of the pods' logs (and of a restarted
    container's previous instance, and of the pod a rank's newest pod replaced).

    States: pending (with the scheduler's reason, or why a rank has no pod), queued (by Kueue, with its
    Workload's reason), suspended, running, succeeded, failed, finished (a StatefulSet idling after training),
    gone. Each rank counts the earlier pods of that rank that failed and were replaced; a Pending rank says why.
    """
    from kubetrain.k8s.cluster.status import format_status, job_status

    cluster = cluster_for(kubeconfig, context)
    result = job_status(cluster, name, namespace or cluster.default_namespace)
    typer.echo(json.dumps(result) if json_ else format_status(result))


def logs(
    name: Annotated[str, typer.Argument(help="Job name.")],
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep streaming new lines.")] = False,
    rank: Annotated[int | None, typer.Option("--rank", help="Only this node rank.")] = None,
    tail: Annotated[int | None, typer.Option("--tail", help="Only the last N lines of each pod.")] = None,
    give_up_after: Annotated[float, typer.Option(
        "--give-up-after", help="With -f: seconds the API server may answer nothing before the follow gives up "
        "(exit 1); failed requests are retried until then.")] = 600.0,
    namespace: NamespaceOpt = None,
    kubeconfig: KubeconfigOpt = None,
    context: ContextOpt = None,
) -> None:
    """Every rank's log, interleaved as it arrives, prefixed with the rank.

    With -f, ranks whose pod is not scheduled or still starting are waited for, a rank is followed into
    the pod that replaces a failed one, and the command ends when the job has ended (exit 1 when it failed).
    A restarting or unreachable API server is waited out (one line), for up to --give-up-after seconds.
    Without -f, a rank with no log yet is named with why (exit 1).
    """
    from kubetrain.k8s.cluster.logs import stream_logs
    from kubetrain.k8s.cluster.outage import Patience

    cluster = cluster_for(kubeconfig, context)
    stream_logs(cluster, name, namespace or cluster.default_namespace, follow=follow, rank=rank, tail=tail,
                emit=lambda line: typer.echo(line), patience=Patience(give_up_after=give_up_after))


def stop(
    name: Annotated[str, typer.Argument(help="Job name.")],
    namespace: NamespaceOpt = None,
    kubeconfig: KubeconfigOpt = None,
    context: ContextOpt = None,
) -> None:
    """Delete the job (its pods save a checkpoint on SIGTERM and exit 75); the claims stay, so a launch resumes.

    Acts on the workload kind that was launched; kinds this user may not list are skipped.
    """
    from kubetrain.k8s.cluster.launch import stop as delete_job

    cluster = cluster_for(kubeconfig, context)
    delete_job(cluster, name, namespace or cluster.default_namespace, log=typer.echo)


def list_(
    namespace: NamespaceOpt = None,
    all_namespaces: Annotated[bool, typer.Option("--all-namespaces", "-A", help="Every namespace.")] = False,
    kubeconfig: KubeconfigOpt = None,
    context: ContextOpt = None,
    json_: JsonOpt = False,
) -> None:
    """The jobs kubetrain launched, with their state."""
    from kubetrain.k8s.cluster.status import list_jobs

    cluster = cluster_for(kubeconfig, context)
    jobs = list_jobs(cluster, namespace or cluster.default_namespace, all_namespaces)
    if json_:
        typer.echo(json.dumps(jobs))
        return
    for job in jobs:
        typer.echo(f"{job['namespace']}/{job['name']}  {job['workload']}  {job['state']}  {job['created']}")
    if not jobs:
        typer.echo("no kubetrain jobs")


def shell(
    name: Annotated[str, typer.Argument(help="Job name.")],
    rank: Annotated[int, typer.Option("--rank", help="Node rank of the pod.")] = 0,
    namespace: NamespaceOpt = None,
    kubeconfig: KubeconfigOpt = None,
    context: ContextOpt = None,
) -> None:
    """An interactive shell in a rank's pod (through `kubectl exec -it`)."""
    import os
    import shutil

    from kubetrain.k8s.cluster.status import job_ranks, main_container

    cluster = cluster_for(kubeconfig, context)
    ns = namespace or cluster.default_namespace
    pod = next((r.pod for r in job_ranks(cluster, name, ns) if r.rank == rank), None)
    if pod is None:
        raise UserInputError(f"job '{name}' has no pod with rank {rank} in namespace {ns}")
    argv = ["kubectl", "exec", "-it", "-n", ns, pod["metadata"]["name"], "-c", main_container(pod)]
    argv += [f"--kubeconfig={kubeconfig}"] if kubeconfig else []
    argv += [f"--context={context}"] if context else []
    argv += ["--", "/bin/sh"]
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise UserInputError("kubectl is not on PATH; it runs the interactive shell: " + " ".join(argv))
    os.execv(kubectl, argv)

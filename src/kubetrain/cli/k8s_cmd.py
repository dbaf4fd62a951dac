"""`kubetrain k8s render|launch|status|logs|stop|list|shell|fetch|backup|doctor|simulate|entrypoint`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from kubetrain.cli.helm_format import Format, FormatOpt, require_folder, write_job_chart
from kubetrain.cli.options import ConfigArg, JsonOpt, PresetOpt, SetOpt, load
from kubetrain.errors import UserInputError
from kubetrain.k8s.workloads import WORKLOADS

app = typer.Typer(help="Render, launch and manage training jobs on Kubernetes, and fetch their runs back.",
                  no_args_is_help=True)

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
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Have the API server validate everything; store nothing.")]
CrdsOpt = Annotated[
    Path | None,
    typer.Option("--crds", help="Folder of CRD *.yaml files to check custom resources against offline "
                 "(default: $KUBETRAIN_CRD_DIR; `launch` uses the cluster's own CRDs when it may read them)."),
]


def _workload(name: str | None) -> str | None:
    if name is not None and name not in WORKLOADS:
        raise UserInputError(f"--workload: unknown workload '{name}'; choose one of {', '.join(WORKLOADS)}")
    return name


def _rendered(config: Path | None, preset: str | None, set_: list[str] | None, workload: str | None,
              namespace: str | None) -> list[dict[str, Any]]:
    from kubetrain.k8s.render.grace import measured_locally, render_note
    from kubetrain.k8s.render.manifest import pod_security_note, render

    overrides = list(set_ or [])
    if namespace:
        overrides.append(f"k8s.namespace={namespace}")
    cfg = load(config, preset, overrides)
    measured = measured_locally(cfg)  # a local or fetched run's save time lengthens the grace period
    objects = render(cfg, _workload(workload), measured)
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


def cluster_for(kubeconfig: Path | None, context: str | None) -> Any:
    from kubetrain.k8s.cluster.api import connect

    return connect(kubeconfig, context)


@app.command()
def render(
    config: ConfigArg = None,
    preset: PresetOpt = None,
    set_: SetOpt = None,
    workload: WorkloadOpt = None,
    namespace: NamespaceOpt = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write one file per object and a "
                                                "kustomization.yaml into this folder instead of printing.")] = None,
    no_validate: NoValidateOpt = False,
    crds: CrdsOpt = None,
    fmt: FormatOpt = Format.yaml,
) -> None:
    """Print the job's Kubernetes objects as YAML, validated strictly against their schemas.

    The grace period follows the save time a local or fetched run of the config measured (runs/<run.name>);
    a note on stderr says so, since the manifest then changes with it. --format helm -o DIR writes a chart:
    image, namespace, nodes, resources, Secrets' names and the tracking URI in its values.yaml.
    """
    from kubetrain.k8s.render.validate import offline_schemas

    require_folder(fmt, output)
    objects = _rendered(config, preset, set_, workload, namespace)
    if not no_validate:
        validate_objects(objects, offline_schemas(crds))
    if fmt is Format.helm and output is not None:
        overrides = [*(set_ or []), *([f"k8s.namespace={namespace}"] if namespace else [])]
        write_job_chart(load(config, preset, overrides), objects, output, _workload(workload))
        return
    print_or_write(objects, output)


@app.command()
def launch(
    config: ConfigArg = None,
    preset: PresetOpt = None,
    set_: SetOpt = None,
    workload: WorkloadOpt = None,
    namespace: NamespaceOpt = None,
    kubeconfig: KubeconfigOpt = None,
    context: ContextOpt = None,
    crds: CrdsOpt = None,
    dry_run: DryRunOpt = False,
) -> None:
    """Apply the job's objects, after the API server accepted all of them in a dry run.

    Relaunching an unchanged running job changes nothing; a finished job, or a running one whose spec
    changed, is refused with what to do (nothing is changed on the cluster then).
    """
    from kubetrain.k8s.cluster.launch import cr_schemas
    from kubetrain.k8s.cluster.launch import launch as apply_job

    objects = _rendered(config, preset, set_, workload, namespace)
    cluster = cluster_for(kubeconfig, context)
    validate_objects(objects, cr_schemas(cluster, objects, crds))
    applied = apply_job(cluster, objects, dry_run=dry_run, log=typer.echo)
    if applied and not dry_run:
        name = objects[-1]["metadata"]["name"]
        typer.echo(f"follow it: kubetrain k8s logs {name} -f   |   kubetrain k8s status {name}")


@app.command()
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


@app.command()
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


@app.command()
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


@app.command("list")
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


@app.command()
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


@app.command()
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


@app.command()
def doctor(
    config: ConfigArg = None,
    preset: PresetOpt = None,
    set_: SetOpt = None,
    workload: WorkloadOpt = None,
    namespace: NamespaceOpt = None,
    kubeconfig: KubeconfigOpt = None,
    context: ContextOpt = None,
) -> None:
    """Check that the cluster can run this job: reachable, namespace, CRD, access, nodes, storage, Secrets, bucket.

    Access: this user may create the workload's kind (a SelfSubjectAccessReview). Nodes must match the selector
    and admit the pod (taints); they are counted in pod slots: pods of the job's requests that still fit beside
    the running pods;
    storage is a storage class or a free static PersistentVolume; the bucket of checkpoint.uri is listed from
    here when this shell has credentials; the grace period a stopped pod gets to save, and where it came from
    (the save a local or fetched run of the config measured, or the default rule). Checks this user may not run
    (a namespace editor cannot list nodes or storage classes) print "cannot check ...: forbidden"; the others
    still run.
    """
    from kubetrain.k8s.cluster.doctor import run_checks
    from kubetrain.k8s.render.grace import measured_locally

    overrides = list(set_ or []) + ([f"k8s.namespace={namespace}"] if namespace else [])
    cfg = load(config, preset, overrides)
    failed = False
    checks = run_checks(cluster_for(kubeconfig, context), cfg, _workload(workload), measured_locally(cfg))
    for check in checks:
        typer.echo(f"{check.status:<4}  {check.name}: {check.detail}")  # as found: a slow check holds none back
        failed |= check.status == "fail"
    if failed:
        raise typer.Exit(1)


@app.command()
def simulate(
    config: ConfigArg = None,
    preset: PresetOpt = None,
    set_: SetOpt = None,
    workload: WorkloadOpt = None,
    root: Annotated[Path, typer.Option("--root", help="Folder for the pods' volumes and logs.")] = Path(
        "runs/k8s-simulate"
    ),
    timeout: Annotated[float | None, typer.Option("--timeout", help="Give up after this many seconds.")] = (
        None
    ),
    volume: Annotated[list[str] | None, typer.Option(
        "--volume", help="NAME=PATH: bind a local folder to a claim the pods mount (NAME: the claim or its volume "
        "name, e.g. data); an unbound claim is an empty folder under --root.")] = None,
) -> None:
    """Run each pod of the job as a local process, with the environment its controller would set."""
    from kubetrain.k8s.simulate import Simulation

    bound: dict[str, Path] = {}
    for item in volume or []:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise UserInputError(f"--volume must be NAME=PATH, got '{item}'")
        bound[name] = Path(path).expanduser()
    sim = Simulation(load(config, preset, set_), root, _workload(workload), volumes=bound)
    typer.echo(f"simulating {sim.kind} '{sim.name}': {len(sim.pods)} pods under {sim.root}")
    try:
        result = sim.run(timeout)
    except KeyboardInterrupt:
        sim.stop()
        raise typer.Exit(130) from None
    typer.echo(f"{'ok' if result.succeeded else 'failed'}: {result.message}")
    if not result.succeeded:
        raise typer.Exit(1)


@app.command()
def entrypoint(
    config: Annotated[Path, typer.Option("--config", help="The mounted config.")] = Path(
        "/etc/kubetrain/config.yaml"
    ),
    rdzv_id: Annotated[str, typer.Option("--rdzv-id", help="Rendezvous id (the job name).")] = "kubetrain",
    max_restarts: Annotated[int, typer.Option("--max-restarts", min=0, help="torchrun restarts.")] = 3,
    wait_timeout: Annotated[float, typer.Option("--wait-timeout", min=0, help="Seconds to wait for the "
                                                "rendezvous endpoint.")] = 900,
    shutdown_timeout: Annotated[int, typer.Option("--shutdown-timeout", min=1, help="Seconds torchrun "
                                                  "gives workers to save after SIGTERM.")] = 90,
    output_dir: Annotated[str | None, typer.Option("--output-dir", help="Override run.output_dir (the "
                                                   "checkpoint volume).")] = None,
    idle_after_finish: Annotated[bool, typer.Option("--idle-after-finish", help="Stay up after training "
                                                    "finished (StatefulSet pods).")] = False,
) -> None:
    """What every training pod runs: node rank from the workload, wait for the rendezvous, run the elastic
    agent; exit 75 when stopped by SIGTERM after a checkpoint."""
    from kubetrain.k8s.pod.entrypoint import run

    code = run(config, rdzv_id=rdzv_id, max_restarts=max_restarts, wait_timeout=wait_timeout,
               shutdown_timeout=shutdown_timeout, output_dir=output_dir, idle_after_finish=idle_after_finish)
    raise typer.Exit(code)


@app.command()
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

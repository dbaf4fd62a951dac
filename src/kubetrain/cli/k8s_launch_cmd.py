"""`kubetrain k8s render|launch|doctor`: a config's job as objects, applied to the cluster, and whether the
cluster can run it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kubetrain.cli.helm_format import Format, FormatOpt, require_folder, write_job_chart
from kubetrain.cli.k8s_objects import print_or_write, rendered, validate_objects
from kubetrain.cli.k8s_options import (
    ContextOpt,
    CrdsOpt,
    DryRunOpt,
    KubeconfigOpt,
    NamespaceOpt,
    NoValidateOpt,
    WorkloadOpt,
    checked_workload,
    cluster_for,
)
from kubetrain.cli.options import ConfigArg, PresetOpt, SetOpt, load


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
    objects = rendered(config, preset, set_, workload, namespace)
    if not no_validate:
        validate_objects(objects, offline_schemas(crds))
    if fmt is Format.helm and output is not None:
        overrides = [*(set_ or []), *([f"k8s.namespace={namespace}"] if namespace else [])]
        write_job_chart(load(config, preset, overrides), objects, output, checked_workload(workload))
        return
    print_or_write(objects, output)


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

    objects = rendered(config, preset, set_, workload, namespace)
    cluster = cluster_for(kubeconfig, context)
    validate_objects(objects, cr_schemas(cluster, objects, crds))
    applied = apply_job(cluster, objects, dry_run=dry_run, log=typer.echo)
    if applied and not dry_run:
        name = objects[-1]["metadata"]["name"]
        typer.echo(f"follow it: kubetrain k8s logs {name} -f   |   kubetrain k8s status {name}")


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
    checks = run_checks(cluster_for(kubeconfig, context), cfg, checked_workload(workload), measured_locally(cfg))
    for check in checks:
        typer.echo(f"{check.status:<4}  {check.name}: {check.detail}")  # as found: a slow check holds none back
        failed |= check.status == "fail"
    if failed:
        raise typer.Exit(1)

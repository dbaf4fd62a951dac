"""The options the `kubetrain k8s` commands share (`k8s platform` too), and the cluster they name."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from kubetrain.errors import UserInputError
from kubetrain.k8s.workloads import WORKLOADS

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


def checked_workload(name: str | None) -> str | None:
    """The --workload given, checked against the table of workloads (None: the config's k8s.workload)."""
    if name is not None and name not in WORKLOADS:
        raise UserInputError(f"--workload: unknown workload '{name}'; choose one of {', '.join(WORKLOADS)}")
    return name


def cluster_for(kubeconfig: Path | None, context: str | None) -> Any:
    """The API server of a kubeconfig (or, in a pod, its own) and context."""
    from kubetrain.k8s.cluster.connect import connect

    return connect(kubeconfig, context)

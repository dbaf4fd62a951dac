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
    """What every training pod runs: node rank from the workload, wait for the rendezvous, start torchrun."""
    from kubetrain.k8s.entrypoint import run

    code = run(config, rdzv_id=rdzv_id, max_restarts=max_restarts, wait_timeout=wait_timeout,
               shutdown_timeout=shutdown_timeout, output_dir=output_dir, idle_after_finish=idle_after_finish)
    raise typer.Exit(code)


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
) -> None:
    """Run each pod of the job as a local process, with the environment its controller would set."""
    from kubetrain.k8s.simulate import Simulation

    sim = Simulation(load(config, preset, set_), root, _workload(workload))
    typer.echo(f"simulating {sim.kind} '{sim.name}': {len(sim.pods)} pods under {sim.root}")
    try:
        result = sim.run(timeout)
    except KeyboardInterrupt:
        sim.stop()
        raise typer.Exit(130) from None
    typer.echo(f"{'ok' if result.succeeded else 'failed'}: {result.message}")
    if not result.succeeded:
        raise typer.Exit(1)

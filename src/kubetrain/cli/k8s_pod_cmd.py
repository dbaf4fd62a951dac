"""`kubetrain k8s simulate|entrypoint`: the job's pods, as local processes, and what each pod runs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kubetrain.cli.k8s_options import WorkloadOpt, checked_workload
from kubetrain.cli.options import ConfigArg, PresetOpt, SetOpt, load
from kubetrain.errors import UserInputError


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
    from kubetrain.k8s.simulate.simulation import Simulation

    bound: dict[str, Path] = {}
    for item in volume or []:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise UserInputError(f"--volume must be NAME=PATH, got '{item}'")
        bound[name] = Path(path).expanduser()
    sim = Simulation(load(config, preset, set_), root, checked_workload(workload), volumes=bound)
    typer.echo(f"simulating {sim.kind} '{sim.name}': {len(sim.pods)} pods under {sim.root}")
    try:
        result = sim.run(timeout)
    except KeyboardInterrupt:
        sim.stop()
        raise typer.Exit(130) from None
    typer.echo(f"{'ok' if result.succeeded else 'failed'}: {result.message}")
    if not result.succeeded:
        raise typer.Exit(1)


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

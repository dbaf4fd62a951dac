"""`kubetrain doctor [CONFIG]`: this machine's report (the cluster's is `kubetrain k8s doctor`)."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from kubetrain.cli.options import ConfigArg, JsonOpt, PresetOpt, SetOpt, at_least, load


def doctor(
    config: ConfigArg = None, preset: PresetOpt = None, set_: SetOpt = None, json_: JsonOpt = False,
    nproc: Annotated[int, typer.Option("--nproc", callback=at_least(1, "--nproc"), help="Processes per node, as "
                                       "`kubetrain train --nproc`: on the CPU they share this machine's memory.")] = 1,
    nnodes: Annotated[int, typer.Option("--nnodes", callback=at_least(1, "--nnodes"), help="Nodes of the run: the "
                                        "memory estimate is per process of nproc x nnodes, sharded under "
                                        "dist.strategy fsdp/hsdp.")] = 1,
) -> None:
    """Check this machine: device, memory, bf16, attention kernels, versions, disk, extras; with a CONFIG,
    whether the model and a micro-batch fit (an estimate) and the settings a run here would pick."""
    from kubetrain.doctor import doctor as check
    from kubetrain.doctor import render
    from kubetrain.memory import Layout

    cfg = load(config, preset, set_) if (config or preset or set_) else None
    report = check(cfg, Layout.of(cfg, nproc * nnodes, nproc) if cfg else None)
    typer.echo(json.dumps(report) if json_ else render(report))


def register(app: typer.Typer) -> None:
    app.command()(doctor)

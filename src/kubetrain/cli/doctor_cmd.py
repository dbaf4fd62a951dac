"""`kubetrain doctor [CONFIG]`: this machine's report (the cluster's is `kubetrain k8s doctor`);
`kubetrain doctor --check`: a short, real training self-test of this machine's device."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from kubetrain.cli.options import ConfigArg, JsonOpt, PresetOpt, SetOpt, at_least, load
from kubetrain.errors import UserInputError


def doctor(
    config: ConfigArg = None, preset: PresetOpt = None, set_: SetOpt = None, json_: JsonOpt = False,
    nproc: Annotated[int, typer.Option("--nproc", callback=at_least(1, "--nproc"), help="Processes per node, as "
                                       "`kubetrain train --nproc`: on the CPU they share this machine's memory. "
                                       "With --check: the processes whose links the preflight measures.")] = 1,
    nnodes: Annotated[int, typer.Option("--nnodes", callback=at_least(1, "--nnodes"), help="Nodes of the run: the "
                                        "memory estimate is per process of nproc x nnodes, sharded under "
                                        "dist.strategy fsdp/hsdp.")] = 1,
    check: Annotated[bool, typer.Option("--check", help="Run the self-test: train on this device (correctness, "
                                        "speed, memory, distributed, Hugging Face); exit 1 if an item fails.")] = False,
    quick: Annotated[bool, typer.Option("--quick", help="With --check: tiny shapes and few steps (the default "
                                        "on the CPU).")] = False,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="With --check: also write the JSON "
                                                "report to this file.")] = None,
    only: Annotated[str | None, typer.Option("--only", help="With --check: these groups only, comma-separated "
                                             "(correctness, speed, memory, distributed, hf).")] = None,
    oversubscribe: Annotated[bool, typer.Option("--oversubscribe", help="Allow --nproc above this machine's CPU "
                                                "cores on a CPU run, as `kubetrain train --oversubscribe`.")] = False,
) -> None:
    """Check this machine: device, memory, bf16, attention kernels, versions, disk, extras; with a CONFIG,
    whether the model and a micro-batch fit (an estimate) and the settings a run here would pick.
    With --check, train for real on this device and report what passed, failed or was skipped, and why."""
    if check:
        _self_test(quick, json_, output, config is not None or preset is not None or bool(set_), only, nproc)
        return
    if quick or output or only:
        raise UserInputError("--quick, --output and --only go with --check")
    from kubetrain.doctor import doctor as describe
    from kubetrain.doctor import render
    from kubetrain.memory import Layout

    cfg = load(config, preset, set_) if (config or preset or set_) else None
    if cfg is not None:
        from kubetrain.launch.admission import check_cores

        check_cores(cfg, nproc, oversubscribe)  # what `kubetrain train --nproc` would refuse, refused here too
    report = describe(cfg, Layout.of(cfg, nproc * nnodes, nproc) if cfg else None)
    typer.echo(json.dumps(report) if json_ else render(report))


def _self_test(quick: bool, json_: bool, output: Path | None, with_config: bool, only: str | None,
               nproc: int = 1) -> None:
    from kubetrain.files import write_atomic
    from kubetrain.selftest import GROUPS
    from kubetrain.selftest.render import item_line, table
    from kubetrain.selftest.runner import run_check

    if with_config:
        raise UserInputError("--check takes no CONFIG, --preset or --set: it trains its own small models")
    if output is not None and output.is_dir():
        raise UserInputError(f"--output {output} is a folder; name a file")
    groups = tuple(GROUPS)
    if only is not None:
        groups = tuple(g.strip() for g in only.split(",") if g.strip())
        unknown = [g for g in groups if g not in GROUPS]
        if unknown or not groups:
            raise UserInputError(f"--only: no such group {', '.join(unknown) or repr(only)} "
                                 f"(groups: {', '.join(GROUPS)})")

    def progress(outcome: Any) -> None:
        typer.echo(item_line(outcome), err=True)

    report = run_check(quick=True if quick else None, on_item=progress, groups=groups, nproc=nproc)
    if output is not None:
        write_atomic(output, json.dumps(report, indent=2) + "\n")
    if json_:
        typer.echo(json.dumps(report))
    else:
        table(report)
    if not report["ok"]:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command()(doctor)

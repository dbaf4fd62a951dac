"""`kubetrain train`."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kubetrain.cli.options import ConfigArg, JsonOpt, PresetOpt, SetOpt, at_least, load
from kubetrain.distributed.env import process_env
from kubetrain.errors import UserInputError

if TYPE_CHECKING:
    from kubetrain.config.schema import Config


def train(
    config: ConfigArg = None,
    preset: PresetOpt = None,
    set_: SetOpt = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Build everything, run one forward pass, exit.")
    ] = False,
    json_: JsonOpt = False,
    resume: Annotated[
        str,
        typer.Option("--resume", help="auto: continue from the latest good checkpoint; never; or a PATH."),
    ] = "auto",
    phase: Annotated[str | None, typer.Option("--phase", help="Run only this phase of `phases:`.")] = None,
    nproc: Annotated[
        int | None, typer.Option("--nproc", callback=at_least(1, "--nproc"),
                                  help="Processes per node, started by torch.distributed.run.")
    ] = None,
    nnodes: Annotated[str, typer.Option("--nnodes", help="Nodes: N, or MIN:MAX for an elastic job.")] = "1",
    node_rank: Annotated[
        int | None, typer.Option("--node-rank", callback=at_least(0, "--node-rank"), help="This node's rank.")
    ] = None,
    rdzv_endpoint: Annotated[
        str | None, typer.Option("--rdzv-endpoint", help="HOST:PORT of the c10d rendezvous (several nodes).")
    ] = None,
    rdzv_id: Annotated[str, typer.Option("--rdzv-id", help="Job id shared by all nodes.")] = "kubetrain",
    max_restarts: Annotated[
        int, typer.Option("--max-restarts", callback=at_least(0, "--max-restarts"),
                          help="Times the agent restarts the workers after one dies; each restart resumes.")
    ] = 3,
    oversubscribe: Annotated[
        bool, typer.Option("--oversubscribe", help="Allow --nproc above this machine's CPU cores on a CPU run "
                           "(refused otherwise: each process waits for a core and holds its own memory).")
    ] = False,
) -> None:
    """Train a model from a config (the embedded 'tiny' preset when none is given).

    Every config key, its type, default and meaning: kubetrain config explain [KEY].
    """
    cfg = load(config, preset, set_)
    check_torch()
    check_resume_path(resume)
    if nproc is not None or nnodes != "1" or rdzv_endpoint is not None or node_rank is not None:
        forwarded = [str(config)] if config else (["--preset", preset] if preset else [])
        for item in set_ or []:
            forwarded += ["--set", item]
        forwarded += ["--resume", resume, *(["--phase", phase] if phase else []), *(["--json"] if json_ else []),
                      *(["--dry-run"] if dry_run else [])]
        raise typer.Exit(_launch(cfg, forwarded, nproc or 1, nnodes, node_rank, rdzv_endpoint, rdzv_id,
                                 max_restarts, oversubscribe, dry_run))

    from kubetrain.secrets import redact, redact_text
    from kubetrain.track.console import console_log
    from kubetrain.train.phases import train_all

    penv = process_env()
    log = console_log(f"[rank {penv.rank}] " if penv.distributed else "")
    result = train_all(cfg, argv=sys.argv[1:], resume=resume, dry_run=dry_run, only_phase=phase, log=log)
    if not penv.is_main:
        return  # rank 0 reports for the job
    if json_:
        typer.echo(json.dumps(redact(result.to_json())))
        return
    if dry_run:
        return
    if result.sample:
        typer.echo("\n--- sample ---\n" + redact_text(result.sample.strip()) + "\n--------------")
    val = f"{result.final_val_loss:.4f}" if result.final_val_loss is not None else "n/a"
    typer.echo(f"done: {result.steps} steps, {result.tokens:,} tokens, val loss {val}")
    typer.echo(f"run directory: {Path(result.run_dir)}")


def _launch(cfg: Config, forwarded: list[str], nproc: int, nnodes: str, node_rank: int | None,
            rdzv_endpoint: str | None, rdzv_id: str, max_restarts: int, oversubscribe: bool, dry_run: bool) -> int:
    """`--nproc`/`--nnodes`: check what can be checked here, then run the elastic agent; its exit code."""
    from kubetrain import runs
    from kubetrain.launch.admission import admit
    from kubetrain.launch.elastic import LaunchOptions, launch, parse_nnodes, torchrun_args
    from kubetrain.launch.watch import watch_options
    from kubetrain.runs.incidents import incidents_dir
    from kubetrain.runs.lock import hold_for_workers
    from kubetrain.train.launch_plan import plan_launch

    fewest_nodes = parse_nnodes(nnodes)[0]
    # the device (one GPU per process, or NCCL fails later), HSDP's shard group, a CPU run's memory: decided once
    plan = plan_launch(cfg, nproc, fewest_nodes, int(nnodes) if nnodes.isdigit() else None)
    opts = LaunchOptions(nproc_per_node=nproc, nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint,
                         rdzv_id=rdzv_id, max_restarts=max_restarts,
                         shutdown_timeout=int(cfg.checkpoint.grace_seconds) + 30, **watch_options(cfg))
    torchrun_args(opts, forwarded)  # bad launch options are refused before the run directory is held
    admit(plan, oversubscribe)  # the plan's cores and memory, before any worker starts
    one_node = nnodes == "1" and rdzv_endpoint is None  # several nodes: rank 0 holds it, wherever it runs
    held: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
    if one_node and not dry_run:  # the launcher holds it across the agent's restarts of its workers
        held = hold_for_workers(runs.run_dir(cfg), lambda m: typer.echo(m, err=True))
    run_dir = runs.run_dir(cfg)
    # A dry run writes no run directory: the folders the launcher makes for its workers (incidents/ for the
    # flight recorder's dumps) go again when nothing was put in them.
    made = [p for p in (run_dir, incidents_dir(run_dir)) if dry_run and not p.exists()]
    try:
        with held:
            return launch(opts, forwarded, run_dir)
    finally:
        for folder in reversed(made):
            with contextlib.suppress(OSError):  # not empty: something worth keeping was written
                folder.rmdir()


def check_torch() -> None:
    """A torch older than kubetrain supports is one line (exit 2), not an ImportError deep in the run."""
    from kubetrain.torch_compat import unsupported_torch

    if problem := unsupported_torch():
        raise UserInputError(problem)


def check_resume_path(resume: str) -> None:
    """A --resume PATH that does not exist is one line before anything is built: --dry-run and launchers too."""
    if resume not in ("auto", "never") and not Path(resume).exists():
        raise UserInputError(f"--resume: no such checkpoint or run directory: {resume}")


def register(app: typer.Typer) -> None:
    app.command()(train)

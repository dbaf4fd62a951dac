"""`kubetrain train`."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from kubetrain.cli.options import ConfigArg, JsonOpt, PresetOpt, SetOpt, load


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
) -> None:
    """Train a model from a config (the embedded 'tiny' preset when none is given)."""
    from kubetrain.train.phases import train_all

    cfg = load(config, preset, set_)
    result = train_all(cfg, argv=sys.argv[1:], resume=resume, dry_run=dry_run, only_phase=phase)
    if json_:
        typer.echo(json.dumps(result.to_json()))
        return
    if dry_run:
        return
    if result.sample:
        typer.echo("\n--- sample ---\n" + result.sample.strip() + "\n--------------")
    val = f"{result.final_val_loss:.4f}" if result.final_val_loss is not None else "n/a"
    typer.echo(f"done: {result.steps} steps, {result.tokens:,} tokens, val loss {val}")
    typer.echo(f"run directory: {Path(result.run_dir)}")


def register(app: typer.Typer) -> None:
    app.command()(train)

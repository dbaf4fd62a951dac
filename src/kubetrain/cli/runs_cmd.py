"""`kubetrain runs list|show`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from kubetrain.cli.options import JsonOpt
from kubetrain.errors import UserInputError

app = typer.Typer(help="List and inspect run directories.", no_args_is_help=True)


@app.command("list")
def list_runs(
    folder: Annotated[Path, typer.Argument(help="Folder of run directories.")] = Path("runs"),
    json_: JsonOpt = False,
) -> None:
    """Every run under FOLDER with its status, step, tokens, best val loss and latest checkpoint."""
    from kubetrain.report import list_runs as find

    rows = find(folder)
    if json_:
        typer.echo(json.dumps(rows))
        return
    if not rows:
        typer.echo(f"no runs in {folder}")
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("run", "status", "phase", "step", "tokens", "best val", "latest")
    for r in rows:
        best = f"{r['best_val_loss']:.4f}" if r.get("best_val_loss") is not None else "-"
        table.add_row(r["name"], r["status"], r.get("phase") or "-", str(r["step"]), f"{r['tokens']:,}", best,
                      r.get("latest") or "-")
    Console().print(table)


@app.command()
def show(run_dir: Annotated[Path, typer.Argument(help="A run directory.")], json_: JsonOpt = False) -> None:
    """Status, progress, losses and checkpoints of one run."""
    from kubetrain.report import describe_run

    if not run_dir.is_dir():
        raise UserInputError(f"no such run directory: {run_dir}")
    info = describe_run(run_dir)
    if json_:
        typer.echo(json.dumps(info))
        return
    for key, value in info.items():
        if key != "checkpoints":
            typer.echo(f"{key:>16}: {value}")
    typer.echo(f"{'checkpoints':>16}: {', '.join(info['checkpoints']) or '-'}")

"""`kubetrain runs list|show|compare|plot|sync`."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from kubetrain.cli.options import JsonOpt
from kubetrain.errors import UserInputError

app = typer.Typer(help="List, inspect, compare and plot run directories.", no_args_is_help=True)


@app.command("list")
def list_runs(
    folder: Annotated[Path | None, typer.Argument(help="Folder of run directories (default: runs).")] = None,
    json_: JsonOpt = False,
) -> None:
    """Every run under FOLDER with its status, step, tokens, best val loss and latest checkpoint."""
    from kubetrain.runs.reader import list_runs as find

    if folder is not None and not folder.is_dir():  # a folder named by hand; ./runs before a first run has none
        raise UserInputError(f"no such folder: {folder}" if not folder.exists() else f"{folder} is not a folder")
    folder = folder or Path("runs")
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
    from kubetrain.runs.reader import describe_run, is_run_dir

    if not run_dir.is_dir():
        raise UserInputError(f"no such run directory: {run_dir}")
    if not is_run_dir(run_dir):
        raise UserInputError(f"{run_dir} is not a run directory (no meta.json, config.yaml or phases/)")
    info = describe_run(run_dir)
    if json_:
        typer.echo(json.dumps(info))
        return
    from kubetrain.runs.incidents import describe

    for key, value in info.items():
        if key not in ("checkpoints", "incidents", "preflight"):
            typer.echo(f"{key:>16}: {_shown(key, value)}")
    typer.echo(f"{'preflight':>16}: {preflight_line(info['preflight'])}")
    for line in (info["preflight"] or {}).get("problems", []):
        typer.echo(f"{'':>18}{line}")
    typer.echo(f"{'checkpoints':>16}: {', '.join(info['checkpoints']) or '-'}")
    typer.echo(f"{'incidents':>16}: {len(info['incidents']) or '-'}")
    for entry in info["incidents"]:
        typer.echo(f"{'':>18}{describe(entry)}")


def preflight_line(summary: dict[str, Any] | None) -> str:
    """`ok in 1.2 s: all-reduce 0.77 GB/s, send/recv 1.2 GB/s (slowest 1.1 GB/s, ranks 0-1)`, or '-'."""
    if not summary:
        return "-"
    slowest = summary.get("slowest_link")
    link = (f", send/recv {_gbps(summary['link_bandwidth'])} (slowest {_gbps(slowest['bandwidth'])}, ranks "
            f"{slowest['ranks'][0]}-{slowest['ranks'][1]})") if slowest else ""
    return (f"{'ok' if summary['ok'] else 'FAILED'} in {summary['seconds']:.1f} s over {summary['world_size']} "
            f"ranks: all-reduce {_gbps(summary['all_reduce_busbw'])}{link}")


def _gbps(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e9:.3g} GB/s"


def _shown(key: str, value: Any) -> str:
    """A value of `runs show` for a reader: '-' for none, local dates, 4-decimal losses, thousands separated."""
    if value is None or value == []:
        return "-"
    if isinstance(value, list):
        return ", ".join(str(v) for v in value)
    if key.endswith("_at") and isinstance(value, int | float):
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(value))
    if key.endswith("loss") and isinstance(value, float):
        return f"{value:.4f}"
    if key == "tokens" and isinstance(value, int):
        return f"{value:,}"
    return str(value)


RunDirsArg = Annotated[list[Path], typer.Argument(help="Run directories (a run with phases: each phase).")]
XOpt = Annotated[str, typer.Option("--x", help="x axis: step, or tokens to compare different batch sizes.")]


@app.command()
def compare(run_dirs: RunDirsArg, json_: JsonOpt = False) -> None:
    """Final and best losses, tokens, throughput and the config keys that differ, side by side."""
    import sys

    from rich.console import Console
    from rich.table import Table

    from kubetrain.runs.compare import compare as collect

    result = collect(run_dirs)
    if json_:
        typer.echo(json.dumps(result))
        return
    console = Console(width=None if sys.stdout.isatty() else 200)  # a pipe gets whole rows, not 80 columns
    columns = ("run", "status", "steps", "tokens", "final loss", "best loss", "final val", "best val (step)",
               "tok/s", "mfu", "preflight all-reduce")
    table = Table(*columns, title="runs")
    for r in result["runs"]:
        step = r["best_val_step"]
        best_val = "-" if step is None else f"{_loss(r['best_val_loss'])} ({step})"
        table.add_row(
            r["run"], str(r["status"]), str(r["steps"]), f"{r['tokens']:,}", _loss(r["final_train_loss"]),
            _loss(r["best_train_loss"]), _loss(r["final_val_loss"]), best_val,
            "-" if r["tokens_per_second"] is None else f"{r['tokens_per_second']:,.0f}",
            "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%",
            "-" if not r["preflight"] else f"{_gbps(r['preflight']['all_reduce_busbw'])}"
            f"{'' if r['preflight']['ok'] else ' FAILED'}",
        )
    console.print(table)
    diff = result["config_diff"]
    if not diff:
        console.print("configs: identical")
        return
    changes = Table("config key", *[r["run"] for r in result["runs"]], title="config differences")
    for key, values in diff.items():
        changes.add_row(key, *[_value(v) for v in values])
    console.print(changes)


@app.command()
def plot(
    run_dirs: RunDirsArg,
    output: Annotated[Path, typer.Option("--output", "-o", help="PNG file to write.")] = Path("loss.png"),
    x: XOpt = "step",
) -> None:
    """Train and validation loss curves of one or several runs, as a PNG."""
    from kubetrain.runs.plots import plot_losses

    if x not in ("step", "tokens"):
        raise UserInputError(f"--x must be 'step' or 'tokens', not '{x}'")
    written = plot_losses(run_dirs, output, "tokens" if x == "tokens" else "step")
    typer.echo(f"wrote {written}")


@app.command()
def sync(
    source: Annotated[str, typer.Argument(help="A run directory to push, or a URI to pull.")],
    destination: Annotated[str, typer.Argument(help="A URI to push to, or a run directory to pull into.")],
    endpoint_url: Annotated[
        str | None, typer.Option("--endpoint-url", help="S3-compatible endpoint (MinIO...) for s3:// URIs.")
    ] = None,
) -> None:
    """Copy a whole run directory to object storage (RUN_DIR URI) or back (URI RUN_DIR); only changed files."""
    from kubetrain.checkpoint.sync import sync_run

    result = sync_run(source, destination, endpoint_url)
    verb = "pushed" if result.direction == "push" else "pulled"
    typer.echo(f"{verb} {len(result.copied)} files ({result.nbytes / 1e6:.1f} MB) from {source} to {destination}; "
               f"{result.unchanged} unchanged")


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _value(value: Any) -> str:
    if value is None:
        return "-"
    return value if isinstance(value, str) else json.dumps(value)

"""`kubetrain config validate|show`."""

from __future__ import annotations

import json

import typer

from kubetrain.cli.options import ConfigArg, JsonOpt, PresetOpt, SetOpt, load
from kubetrain.config import preset_names, to_yaml

app = typer.Typer(help="Check and print configs.", no_args_is_help=True)


@app.command()
def validate(config: ConfigArg = None, preset: PresetOpt = None, set_: SetOpt = None) -> None:
    """Load and validate a config; exit 2 with one line if it is wrong."""
    cfg = load(config, preset, set_)
    typer.echo(f"ok: {config or f'preset {preset or cfg.run.name}'} is valid")


@app.command()
def show(config: ConfigArg = None, preset: PresetOpt = None, set_: SetOpt = None, json_: JsonOpt = False) -> None:
    """Print the resolved config, every default filled in."""
    cfg = load(config, preset, set_)
    typer.echo(json.dumps(cfg.model_dump(mode="json"), indent=2) if json_ else to_yaml(cfg), nl=not json_ or True)


@app.command()
def presets() -> None:
    """List the presets shipped with kubetrain."""
    for name in preset_names():
        typer.echo(name)

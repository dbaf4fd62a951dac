"""`kubetrain config validate|show|presets|explain`."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from kubetrain.cli.options import ConfigArg, JsonOpt, PresetOpt, SetOpt, load

app = typer.Typer(help="Check and print configs.", no_args_is_help=True)


@app.command()
def validate(config: ConfigArg = None, preset: PresetOpt = None, set_: SetOpt = None) -> None:
    """Load and validate a config; exit 2 with one line if it is wrong."""
    from kubetrain.config import DEFAULT_PRESET

    load(config, preset, set_)
    typer.echo(f"ok: {config or f'preset {preset or DEFAULT_PRESET}'} is valid")


@app.command()
def show(
    config: ConfigArg = None, preset: PresetOpt = None, set_: SetOpt = None, json_: JsonOpt = False
) -> None:
    """Print the resolved config, every default filled in."""
    from kubetrain.config import to_yaml

    cfg = load(config, preset, set_)
    # --json is one line, like every --json: the last line of stdout is the object.
    typer.echo(json.dumps(cfg.model_dump(mode="json")) if json_ else to_yaml(cfg).rstrip("\n"))


@app.command()
def presets() -> None:
    """List the presets shipped with kubetrain."""
    from kubetrain.config import preset_names

    for name in preset_names():
        typer.echo(name)


@app.command()
def explain(
    key: Annotated[
        str | None, typer.Argument(help="A key or section: train.lr, data.sources.0.kind, k8s (default: all).")
    ] = None,
    json_: JsonOpt = False,
) -> None:
    """Print each config key's type, default and description, from the schema itself."""
    from kubetrain.config.explain import explain as explain_keys
    from kubetrain.config.explain import render, to_json

    docs = explain_keys(key)
    typer.echo(to_json(docs) if json_ else render(docs))

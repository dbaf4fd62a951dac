"""Options shared by every command that takes a CONFIG: the file or --preset, and --set overrides."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kubetrain.config import Config, load_config

ConfigArg = Annotated[
    Path | None, typer.Argument(help="YAML config file (default: the 'tiny' preset).", show_default=False)
]
PresetOpt = Annotated[str | None, typer.Option("--preset", "-p", help="A config shipped with kubetrain.")]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override a key: --set train.lr=1e-3 (repeatable).", show_default=False),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object (last line of stdout).")]


def load(config: Path | None, preset: str | None, overrides: list[str] | None) -> Config:
    return load_config(config, preset, overrides or [])

"""Options shared by every command that takes a CONFIG: the file or --preset, and --set overrides."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer

from kubetrain.errors import UserInputError

if TYPE_CHECKING:  # the schema loads with the first config, not with every command's --help
    from kubetrain.config import Config

Number = TypeVar("Number", int, float)

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
    from kubetrain.config import load_config

    return load_config(config, preset, overrides or [])


def at_least(low: float, flag: str) -> Callable[[Number | None], Number | None]:
    """An option callback: a value below `low` is one `error:` line and exit 2 (typer's min= prints a usage box)."""

    def check(value: Number | None) -> Number | None:
        if value is not None and value < low:
            raise UserInputError(f"{flag}: must be at least {low:g}, got {value:g}")
        return value

    return check


def positive_seconds(flag: str) -> Callable[[float | None], float | None]:
    """An option callback: seconds above 0 and finite (`nan` compares false with everything: it never gave up)."""

    def check(value: float | None) -> float | None:
        if value is not None and not (math.isfinite(value) and value > 0):
            raise UserInputError(f"{flag}: seconds above 0, got {value:g}")
        return value

    return check


def folder_path(text: str) -> Path:
    """A folder option's value (`-o DIR`): an empty one is refused, not read as `.` (it wrote into the current
    folder, among whatever is there)."""
    if not text.strip():
        raise UserInputError("-o/--output: an empty path; name the folder to write into (`-o .` for this one)")
    return Path(text)

"""`kubetrain prepare`."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from kubetrain.cli.options import ConfigArg, JsonOpt, PresetOpt, SetOpt, at_least, load

NprocOpt = Annotated[
    int, typer.Option("--nproc", callback=at_least(1, "--nproc"),
                      help="Local processes that tokenize parts of the data in parallel.")
]


def prepare(
    config: ConfigArg = None, preset: PresetOpt = None, set_: SetOpt = None, json_: JsonOpt = False,
    nproc: NprocOpt = 1,
) -> None:
    """Tokenize the config's data into token shards (cached by content: a second call is instant)."""
    from kubetrain.data.shards import prepare_in_processes

    cfg = load(config, preset, set_)
    prepared = prepare_in_processes(cfg, nproc, min_tokens=cfg.model.block_size + 1,
                                    log=None if json_ else typer.echo)
    if json_:
        typer.echo(json.dumps({"folder": str(prepared.folder), **prepared.meta}))
        return
    m = prepared.meta
    typer.echo(
        f"{prepared.folder}: {m['tokens']:,} tokens ({m['train_tokens']:,} train, {m['val_tokens']:,} val), "
        f"{m['tokenizer_kind']} tokenizer, vocab {m['vocab_size']:,}"
    )


def register(app: typer.Typer) -> None:
    app.command()(prepare)

"""`kubetrain export`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from kubetrain.cli.options import JsonOpt
from kubetrain.errors import UserInputError

TargetArg = Annotated[Path, typer.Argument(help="A run directory or checkpoint folder.", show_default=False)]
FormatOpt = Annotated[str, typer.Option("--format", "-f", help="hf: Hugging Face folder; gguf: .gguf file.")]
OutputOpt = Annotated[Path | None, typer.Option("--output", "-o", help="Folder (hf) or file (gguf), new.")]
MergeOpt = Annotated[bool, typer.Option("--merge", help="Fold a LoRA run's adapters into the base model.")]
DtypeOpt = Annotated[
    str, typer.Option("--dtype", help="auto, float32, float16, bfloat16 (auto: hf as trained, gguf float16).")
]
WhichOpt = Annotated[str, typer.Option("--checkpoint", help="best or latest (for a run directory).")]


def export(
    target: TargetArg,
    format_: FormatOpt = "hf",
    output: OutputOpt = None,
    merge: MergeOpt = False,
    dtype: DtypeOpt = "auto",
    checkpoint: WhichOpt = "best",
    json_: JsonOpt = False,
) -> None:
    """Export a trained model: Hugging Face (safetensors, config, tokenizer) or GGUF (llama.cpp, Ollama)."""
    from kubetrain.export import export as run_export

    if output is None:
        raise UserInputError("export needs -o OUT: the folder (hf) or .gguf file to write")
    if checkpoint not in ("best", "latest"):
        raise UserInputError("--checkpoint must be 'best' or 'latest'")
    done = run_export(target, format_, output, merge=merge, which=checkpoint, dtype=dtype)
    if json_:
        typer.echo(json.dumps(done.to_json()))
        return
    what = {"model": "model", "merged": "merged model", "adapter": "LoRA adapter"}[done.kind]
    typer.echo(f"wrote {what} of {done.checkpoint} (step {done.step}) as {done.format}: {done.path}")
    if done.modelfile:  # `Modelfile`, or `<name>.Modelfile` where another export's Modelfile is already beside it
        beside = "" if Path(done.modelfile).name == "Modelfile" else " (the Modelfile there is another export's)"
        typer.echo(f"wrote the Ollama Modelfile {done.modelfile}{beside}: ollama create NAME -f {done.modelfile}")


def register(app: typer.Typer) -> None:
    app.command()(export)

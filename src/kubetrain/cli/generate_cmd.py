"""`kubetrain generate`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kubetrain.cli.options import at_least
from kubetrain.errors import UserInputError


def generate(
    run_dir: Annotated[Path, typer.Argument(help="A run directory or a checkpoint folder.")],
    prompt: Annotated[str, typer.Option("--prompt", help="Text to continue.", show_default="a newline")] = "\n",
    max_new_tokens: Annotated[
        int, typer.Option("--max-new-tokens", callback=at_least(1, "--max-new-tokens"))
    ] = 200,
    temperature: Annotated[
        float, typer.Option("--temperature", callback=at_least(0, "--temperature"), help="0 is greedy.")
    ] = 0.8,
    top_k: Annotated[
        int, typer.Option("--top-k", callback=at_least(0, "--top-k"), help="0 keeps every token.")
    ] = 50,
    seed: Annotated[int | None, typer.Option("--seed")] = None,
    checkpoint: Annotated[str, typer.Option("--checkpoint", help="best or latest (for a run directory).")] = "best",
    chat: Annotated[bool, typer.Option("--chat", help="Send the prompt as a user turn of the chat template.")] = False,
) -> None:
    """Continue a prompt with a trained model."""
    import torch

    from kubetrain.data.chat import encode_prompt
    from kubetrain.data.tokenizers import prompt_ids
    from kubetrain.models.load import load_trained
    from kubetrain.models.sampling import Progress
    from kubetrain.models.sampling import generate as sample

    if checkpoint not in ("best", "latest"):
        raise UserInputError("--checkpoint must be 'best' or 'latest'")
    if not prompt:
        raise UserInputError("--prompt is empty: give at least one character to continue")
    check_utf8(prompt, "--prompt")
    model, tokenizer, cfg, _ = load_trained(run_dir, checkpoint)
    if cfg.run.threads:  # as `train` does: the run's run.threads (torch's default is every core, load or not)
        torch.set_num_threads(cfg.run.threads)
    if torch.cuda.is_available():
        model = model.cuda()
    ids = encode_prompt(tokenizer, cfg.data.chat, prompt) if chat else prompt_ids(tokenizer, prompt)
    block = cfg.model.block_size
    out = sample(model, ids, max_new_tokens, block, temperature, top_k or None, tokenizer.eos_id, seed,
                 progress=Progress("generating"))
    typer.echo(prompt + tokenizer.decode(out))


def check_utf8(text: str, flag: str) -> None:
    """An argument with bytes that are not UTF-8 (Python keeps them as lone surrogates) is one line."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start].encode("utf-8", "surrogateescape")
        raise UserInputError(f"{flag} is not UTF-8 text (byte 0x{bad.hex()} at character {e.start})") from None


def register(app: typer.Typer) -> None:
    app.command()(generate)

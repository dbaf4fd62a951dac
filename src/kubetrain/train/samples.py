"""Text samples of the model being trained: one into samples.txt at each evaluation, one at the end of the run."""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from torch import nn

from kubetrain import runs
from kubetrain.config.schema import Config
from kubetrain.data.tokenizers import prompt_ids
from kubetrain.models.sampling import Progress, generate
from kubetrain.secrets import redact_text


def sample_text(model: nn.Module, tokenizer: Any, prompt: str, n: int, block_size: int, seed: int,
                autocast_ctx: Callable[[], AbstractContextManager[Any]], every_rank: bool = False,
                progress: Callable[[int, int], None] | None = None) -> str:
    """`prompt` continued by `n` tokens of `model` (temperature 0.8, top-k 50, `seed`).

    `every_rank` (FSDP/HSDP, where each forward all-gathers the weights): every rank runs all `n` forwards, with no
    stop at end-of-text, which a rank could reach at another token than its peers and leave them waiting in a
    collective; the text is cut there after."""
    eos = tokenizer.eos_id
    out = generate(model, prompt_ids(tokenizer, prompt), n, block_size, temperature=0.8, top_k=50,
                   eos_id=None if every_rank else eos, seed=seed, autocast_ctx=autocast_ctx, progress=progress)
    if eos is not None and eos in out:
        out = out[:out.index(eos)]
    return prompt + tokenizer.decode(out)


class Samples:
    """Rank 0 samples and writes; under FSDP/HSDP every rank takes part in the forwards (each one all-gathers)."""

    def __init__(self, cfg: Config, model: nn.Module, tokenizer: Any,
                 autocast_ctx: Callable[[], AbstractContextManager[Any]], is_rank0: bool, sharded: bool) -> None:
        self.cfg, self.model, self.tokenizer, self.autocast_ctx = cfg, model, tokenizer, autocast_ctx
        self.is_rank0, self.sharded = is_rank0, sharded

    @property
    def here(self) -> bool:
        """Whether this rank takes part in sampling at all (sample_prompt null: no rank does)."""
        return self.cfg.eval.sample_prompt is not None and (self.is_rank0 or self.sharded)

    def text(self, prompt: str, n: int, progress: Progress | None = None) -> str:
        """`prompt` continued by `n` tokens."""
        return sample_text(self.model, self.tokenizer, prompt, n, self.cfg.model.block_size, self.cfg.run.seed,
                           self.autocast_ctx, every_rank=self.sharded, progress=progress)

    def at_end(self, say: Callable[[str], None]) -> str | None:
        """The end-of-training sample (3x eval.sample_tokens), its progress on rank 0's console; None where off."""
        prompt = self.cfg.eval.sample_prompt
        if prompt is None or not self.here:
            return None
        return self.text(prompt, self.cfg.eval.sample_tokens * 3, Progress("end-of-training sample", say))

    def write(self, run_dir: Path, step: int) -> None:
        """A sample at an evaluation, appended to samples.txt by rank 0 (secret-looking text redacted)."""
        prompt = self.cfg.eval.sample_prompt
        if prompt is None or not self.here:
            return
        text = self.text(prompt, self.cfg.eval.sample_tokens)
        if not self.is_rank0:
            return
        with open(run_dir / runs.SAMPLES_FILE, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, "sample": redact_text(text)}) + "\n")

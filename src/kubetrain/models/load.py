"""Load a trained model back from a run directory or a checkpoint folder (generate, export)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
import yaml
from torch import nn

from kubetrain import checkpoint
from kubetrain.checkpoint.read import verify_named
from kubetrain.config.loading import validate
from kubetrain.config.schema import Config
from kubetrain.data.tokenizers import Tokenizer, load_saved_tokenizer
from kubetrain.distributed.parallelize import ShardInit
from kubetrain.errors import KubetrainError, UserInputError
from kubetrain.models import build_model, builds_on_meta, fill_weights
from kubetrain.models.lora import apply_lora
from kubetrain.runs import CHECKPOINTS, CONFIG_FILE, PHASES, last_finished_phase, phase_dirs, read_meta


def locate(target: Path, which: str = "best", warn: Callable[[str], None] | None = None
           ) -> tuple[Path, checkpoint.Checkpoint]:
    """(run directory, checkpoint) for a run directory (its best, else latest) or a checkpoint folder.

    A pointed-to checkpoint that does not verify is skipped with a warning naming it and why.
    """
    warn = warn or (lambda m: print(m, file=sys.stderr, flush=True))
    if not target.exists():
        raise UserInputError(f"no such run directory or checkpoint: {target}")
    if checkpoint.is_checkpoint_dir(target):
        return target.parent.parent, verify_named(target)
    if not (target / CONFIG_FILE).is_file() and phase_dirs(target):
        phase = last_finished_phase(target)
        if phase is None:
            states = ", ".join(f"{d.name} ({read_meta(d).get('status', 'unknown')})" for d in phase_dirs(target))
            raise UserInputError(f"{target} is a run of phases and none has finished yet ({states}); "
                                 f"name one: {target / PHASES}/NAME")
        warn(f"{target}: using phase {phase.name}, the last one that finished ({phase})")
        target = phase
    root = target / CHECKPOINTS
    if not (target / CONFIG_FILE).is_file():
        raise UserInputError(f"{target} is not a run directory (no {CONFIG_FILE})")
    # the pointer asked for, then latest, then every complete checkpoint newest first: the first that verifies
    names = [checkpoint.pointer(root, which), checkpoint.pointer(root, checkpoint.LATEST),
             *(p.name for p in reversed(checkpoint.complete_checkpoints(root)))]
    candidates = list(dict.fromkeys(n for n in names if n and (root / n).is_dir()))
    if not candidates:
        raise UserInputError(f"{target} has no complete checkpoint yet")
    for name in candidates:
        try:
            return target, checkpoint.verify(root / name)
        except (KubetrainError, OSError, ValueError) as e:
            warn(f"warning: checkpoint {name} does not verify ({e}); looking for another")
    raise UserInputError(f"{target} has no checkpoint that verifies")


def run_config(run: Path) -> Config:
    try:
        raw = yaml.safe_load((run / CONFIG_FILE).read_text())
    except OSError:
        raise UserInputError(f"{run} is not a run directory (no {CONFIG_FILE})") from None
    return validate(raw, source=str(run / CONFIG_FILE))


def load_trained(target: Path, which: str = "best") -> tuple[nn.Module, Tokenizer, Config, checkpoint.Checkpoint]:
    """The model with its trained weights, its tokenizer and config, and the checkpoint they came from."""
    run, ckpt = locate(target, which)
    cfg = run_config(run)
    tokenizer = load_saved_tokenizer(run / "tokenizer")
    # A LoRA run's frozen base is rebuilt, not loaded, and must come out as the run drew it: our GPT from ShardInit
    # (train/model_for_world.py), a model built whole from the global RNG as the loop seeds it.
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model, tokenizer.vocab_size)
    if cfg.model.lora is not None:
        model = apply_lora(model, cfg.model.lora)
    if cfg.model.kind == "gpt" and builds_on_meta(cfg.model):
        fill_weights(model, cfg.model, ShardInit(cfg.run.seed))
    state = ckpt.model_state()  # an FSDP checkpoint's shards assembled here, in this process
    _, unexpected = model.load_state_dict(state, strict=False)
    # Frozen base weights come from the config's model; tied aliases are not separate parameters.
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    if unexpected or trainable - set(state):
        raise UserInputError(f"checkpoint {ckpt.path} does not fit the model in {run / CONFIG_FILE}")
    model.eval()
    return model, tokenizer, cfg, ckpt

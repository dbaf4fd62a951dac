"""Phases: named stages (pretrain -> code -> instruct ...) that override data/train/eval and chain weights."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from kubetrain import checkpoint, runs
from kubetrain.config.loading import phase_config
from kubetrain.config.schema import Config
from kubetrain.distributed import preflight
from kubetrain.distributed import setup as dist
from kubetrain.distributed.env import process_env
from kubetrain.errors import TrainingStopped, UserInputError
from kubetrain.runs.lock import hold as hold_run
from kubetrain.runs.lock import job_identity
from kubetrain.track.console import console_log
from kubetrain.train.compile import reset_compiled
from kubetrain.train.device import apply_torch_settings, select_device
from kubetrain.train.result import TrainResult
from kubetrain.train.trainer import train


def train_all(
    cfg: Config, *, argv: list[str], resume: str = "auto", dry_run: bool = False, only_phase: str | None = None,
    log: Any = None,
) -> TrainResult:
    """Train the config; with `phases:`, run the remaining phases in order (or only `only_phase`).

    Rank 0 holds the run directory (a dry run writes nothing there); a second live run on it is refused.
    """
    say = log or console_log()
    held: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
    if not dry_run and process_env().is_main:
        held = hold_run(runs.run_dir(cfg), job_identity(), say)
    healthy = False  # an error on this rank: a peer may be inside a collective, so no barrier on the way out
    try:
        with held:
            check_job(cfg, dry_run, say)
            result = _train_phases(cfg, argv=argv, resume=resume, dry_run=dry_run, only_phase=only_phase, log=log)
        healthy = True
        return result
    except TrainingStopped:
        healthy = True  # every rank stopped at the same step (the trainer's stop vote)
        raise
    finally:
        dist.teardown(healthy)


def check_job(cfg: Config, dry_run: bool, log: Any) -> None:
    """Join the process group and run the job's preflight, once per process (its phases share the group), before
    any model is built; a bad device or link stops the job here (exit 71)."""
    device = select_device(cfg.run.device)
    apply_torch_settings(cfg, device)  # before the preflight's first CUDA kernel, as the Trainer does
    penv = dist.init(cfg.dist, device)
    preflight.check_job(cfg.dist.preflight, penv, device, runs.run_dir(cfg), log, write=not dry_run)


def _train_phases(
    cfg: Config, *, argv: list[str], resume: str, dry_run: bool, only_phase: str | None, log: Any
) -> TrainResult:
    if not cfg.phases:
        if only_phase:
            raise UserInputError(f"--phase {only_phase}: the config has no phases")
        return train(cfg, argv=argv, resume=resume, dry_run=dry_run, log=log)
    names = [p.name for p in cfg.phases]
    if len(set(names)) != len(names):
        raise UserInputError(f"phase names must be unique: {', '.join(names)}")
    if only_phase and only_phase not in names:
        raise UserInputError(f"--phase {only_phase}: no such phase (phases: {', '.join(names)})")
    root = runs.run_dir(cfg)
    result: TrainResult | None = None
    previous: Path | None = None
    main = process_env().is_main
    say = (log or console_log()) if main else (lambda m: None)

    def record(status: str, phase: str) -> None:  # rank 0: how the whole run stands (runs list/show read it)
        if main and not dry_run:
            with contextlib.suppress(OSError):  # the error that ends the run matters more than this record of it
                runs.record_phases(root, names, status, phase)

    current = names[0]
    try:
        for i, ph in enumerate(cfg.phases):
            sub = phase_config(cfg, i)
            path = root / "phases" / ph.name
            where = f"phase {ph.name} ({i + 1} of {len(names)})"
            if only_phase and ph.name != only_phase:
                previous = path
                continue
            if runs.read_meta(path).get("status") == "finished" and not only_phase:
                say(f"{where}: finished before, skipped")
                previous = path
                continue
            say(f"{where}: {path}")
            current = ph.name
            record("running", current)
            if previous is not None:
                sub = with_previous_tokenizer(sub, cfg, i, previous)
            init = None
            if previous is not None and not checkpoint.complete_checkpoints(path / runs.CHECKPOINTS):
                init = _phase_weights(previous, ph.init_from)
            if sub.train.compile is not False:
                reset_compiled()  # the previous phase's graphs and guards would otherwise stay for the whole run
            result = train(sub, argv=argv, resume=resume, dry_run=dry_run, log=log, run_path=path,
                           init_weights=init, init_optimizer=not ph.reset_optimizer, phase=ph.name)
            previous = path
            if dry_run:
                break
    except TrainingStopped:
        record("stopped", current)
        raise
    except BaseException:
        record("failed", current)
        raise
    done = all(runs.read_meta(root / "phases" / n).get("status") == "finished" for n in names)
    record("finished" if done else "stopped", names[-1] if done else current)  # --phase: the rest is still to run
    if result is None:
        last = root / "phases" / names[-1]
        meta = runs.read_meta(last)
        return TrainResult(str(last.resolve()), int(meta.get("step", 0)), int(meta.get("tokens", 0)),
                           meta.get("final_train_loss"), meta.get("final_val_loss"), meta.get("best_val_loss"),
                           0.0, "finished")
    return result


def with_previous_tokenizer(sub: Config, cfg: Config, index: int, previous: Path) -> Config:
    """Phase `index`'s config reading its data with the BPE that the phase before it trained (its run's tokenizer/).

    A BPE is trained on the corpus at prepare time, so a phase that inherits `data.tokenizer` would otherwise train
    its own on its own data, and its ids would not be the ones the previous phase's weights learnt. A phase that
    sets `data.tokenizer` itself keeps it (and is refused weights trained with another one).
    """
    tok = sub.data.tokenizer
    patch = cfg.phases[index].data or {}
    if tok.kind != "bpe" or tok.path or "tokenizer" in patch:
        return sub
    folder = previous / "tokenizer"
    if not (folder / "tokenizer.json").is_file():
        raise UserInputError(f"phase {cfg.phases[index].name} tokenizes its data with the BPE tokenizer that phase "
                             f"{previous.name} trained, and {folder} holds none yet: train phase {previous.name} first")
    data = sub.data.model_copy(update={"tokenizer": tok.model_copy(update={"path": str(folder)})})
    return sub.model_copy(update={"data": data})


def _phase_weights(previous: Path, which: str) -> Path:
    root = previous / runs.CHECKPOINTS
    name = checkpoint.pointer(root, checkpoint.BEST if which == "best" else checkpoint.LATEST)
    name = name or checkpoint.pointer(root, checkpoint.LATEST)
    if not name:
        raise UserInputError(f"phase {previous.name} has no checkpoint to start the next phase from")
    return root / name

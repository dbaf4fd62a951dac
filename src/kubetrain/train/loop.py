"""The training spine: build the components, resume, loop, evaluate, checkpoint, stop."""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kubetrain import runs
from kubetrain.checkpoint import remote
from kubetrain.config.loading import config_hash
from kubetrain.config.schema import Config
from kubetrain.data.loader import TokenWindows, TrainLoader
from kubetrain.data.shards import prepare
from kubetrain.dist import setup as dist
from kubetrain.errors import IncompatibleCheckpointError, TrainingStopped, UserInputError
from kubetrain.models import build_model
from kubetrain.models.lora import apply_lora
from kubetrain.models.sampling import generate
from kubetrain.track.build import build_sinks
from kubetrain.track.console import Throughput
from kubetrain.track.jsonl import truncate_after
from kubetrain.train import checkpoint
from kubetrain.train.device import autocast, memory_gib, peak_flops, resolve_precision
from kubetrain.train.evaluate import evaluate, lm_loss, perplexity
from kubetrain.train.optim import build_optimizer, lr_at, set_lr
from kubetrain.train.sharded import full_model_state
from kubetrain.train.sharded import save_optimizer as save_sharded_optimizer
from kubetrain.train.state import (
    TrainResult,
    TrainState,
    gather_rng,
    load_model_state,
    load_optimizer,
    model_state,
    set_rng_state,
    unwrap,
)
from kubetrain.train.stop import GracefulStop

Log = Callable[[str], None]


def configure_torch(cfg: Config) -> None:
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    if cfg.train.deterministic:
        # warn_only: a few CUDA kernels have no deterministic version; on the CPU everything does.
        torch.use_deterministic_algorithms(True, warn_only=True)
    torch.manual_seed(cfg.run.seed)


def train(
    cfg: Config,
    *,
    argv: list[str] | None = None,
    resume: str = "auto",
    dry_run: bool = False,
    log: Log | None = None,
    run_path: Path | None = None,
    init_weights: Path | None = None,
    init_optimizer: bool = False,
    phase: str | None = None,
) -> TrainResult:
    """Train `cfg` to the end (or until stopped), resuming from the run's checkpoints when there are some.

    Under a launcher this joins the process group; the caller tears it down (phases share one group).
    """
    configure_torch(cfg)
    device = dist.local_device(cfg.run.device)
    penv = dist.init(cfg.dist, device)
    main = penv.is_main
    prefix = f"[rank {penv.rank}] " if penv.distributed else ""
    out: Log = log or (lambda m: print(prefix + m, flush=True))
    say: Log = out if main else (lambda m: None)

    # Data: rank 0 tokenizes; the others then find it in the content-addressed cache.
    need = cfg.model.block_size + 1
    if main:
        prepared = prepare(cfg, min_tokens=need, log=say)
    dist.barrier()
    if not main:
        prepared = prepare(cfg, min_tokens=need)
    if penv.distributed:
        out(f"process {penv.rank}/{penv.world_size} on {device} (local rank {penv.local_rank})")
    tokenizer = prepared.tokenizer()
    train_windows = TokenWindows(prepared, "train", cfg.model.block_size)
    val_windows = TokenWindows(prepared, "val", cfg.model.block_size) if prepared.n_val > need else None

    model = build_model(cfg.model, tokenizer.vocab_size).to(device)
    if cfg.model.lora is not None:
        model = apply_lora(model, cfg.model.lora)
    base = unwrap(model)
    n_params = sum(p.numel() for p in model.parameters())
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    global_batch = cfg.train.micro_batch_size * cfg.train.grad_accum_steps * penv.world_size
    tokens_per_step = global_batch * cfg.model.block_size
    max_steps = cfg.train.max_steps
    if cfg.train.max_tokens:
        max_steps = min(max_steps, math.ceil(cfg.train.max_tokens / tokens_per_step))
    precision = resolve_precision(cfg.train.precision, device)
    amp = autocast(precision, device)
    flops_per_token = getattr(base, "flops_per_token", lambda: 6.0 * n_trainable)()
    peak = peak_flops(device)

    say(
        f"model: {n_params / 1e6:.2f}M parameters ({n_trainable / 1e6:.2f}M trainable) | "
        f"device {device.type} x{penv.world_size} | precision {precision}"
    )
    say(
        f"tokens per step: {tokens_per_step:,} ({cfg.train.micro_batch_size} seq x {cfg.model.block_size} tok x "
        f"{cfg.train.grad_accum_steps} accum x {penv.world_size} ranks) | steps {max_steps} | "
        f"data {prepared.n_train:,} train / {prepared.n_val:,} val tokens ({tokenizer.kind} tokenizer)"
    )
    if dry_run:
        batch = TrainLoader(train_windows, cfg.train.micro_batch_size, cfg.run.seed).next_batch().to(device)
        with torch.no_grad(), amp():
            first_loss = float(lm_loss(model(batch.input_ids), batch.labels))
        say(f"dry run: one forward pass, loss {first_loss:.4f} (ln(vocab) = {math.log(tokenizer.vocab_size):.4f}); "
            "no run directory was written")
        return TrainResult("", 0, 0, first_loss, None, None, 0.0, "dry-run")

    path = run_path or runs.run_dir(cfg)
    ckpt_root = path / runs.CHECKPOINTS
    loader = TrainLoader(train_windows, cfg.train.micro_batch_size, cfg.run.seed, penv.rank, penv.world_size)
    state = TrainState()
    shapes = {k: list(v.shape) for k, v in checkpoint.unique_tensors(model_state(base)).items()}
    if resume == "auto" and penv.local_rank == 0:  # object storage: an empty local folder resumes from there
        remote.restore_newest(cfg, phase, ckpt_root, say)
    dist.barrier()
    resumed = _resume(resume, ckpt_root, path, cfg, say) if resume != "never" else None
    if resume == "never" and checkpoint.complete_checkpoints(ckpt_root):
        raise UserInputError(
            f"{path} already has checkpoints; resume it (--resume auto), or choose another run.name"
        )
    # Weights go into the single-device model before it is wrapped; the optimizer is built on the wrapped
    # model's parameters (FSDP replaces them with shards) and its state loaded after.
    source = resumed or (checkpoint.resolve(init_weights) if init_weights is not None else None)
    if source is not None:
        checkpoint.check_compatible(source, shapes, tokenizer_fingerprint(prepared))
        load_model_state(base, source.model_state())
    model = dist.wrap(model, cfg.dist, penv, device)
    sharded = penv.distributed and cfg.dist.strategy == "fsdp"
    optimizer = build_optimizer(model, cfg.train, device)
    if resumed is not None:
        trainer = resumed.trainer_state()
        load_optimizer(model, optimizer, resumed, trainer, sharded)
        try:
            loader.load_state_dict(trainer["loader"])
        except ValueError as e:
            raise IncompatibleCheckpointError(f"cannot resume {resumed.path}: {e}") from None
        state = TrainState(**trainer["state"])
        rngs = trainer["rng"]
        if len(rngs) == penv.world_size:
            set_rng_state(rngs[penv.rank])
        else:
            say(f"note: the checkpoint has RNG states of {len(rngs)} ranks, this run has {penv.world_size}")
        say(f"resuming from {resumed.path} (step {state.step}, {state.tokens:,} tokens)")
    elif source is not None:
        if init_optimizer:
            load_optimizer(model, optimizer, source, source.trainer_state(), sharded)
        say(f"starting from the weights{' and optimizer state' if init_optimizer else ''} of {source.path}")
    if cfg.train.compile:
        model = torch.compile(model)  # type: ignore[assignment]

    if main:
        meta = runs.start(path, cfg, argv if argv is not None else sys.argv[1:], penv.world_size, phase=phase)
        for change in meta["config_changes"]:
            say(f"config changed since the last start: {change}")
        truncate_after(path / runs.METRICS_FILE, state.step)
        truncate_after(path / runs.SAMPLES_FILE, state.step)
        tokenizer.save(path / "tokenizer")
    sinks = build_sinks(cfg, path, max_steps, prefix=prefix) if main else None
    uploader = remote.Uploader.from_config(cfg, phase, ckpt_root, say) if main else None  # object storage
    if sinks:
        sinks.start({"run_dir": str(path), "run": cfg.run.name, "start_step": state.step, "params": n_params,
                     "phase": phase, "config": cfg, "max_steps": max_steps, "restarts": penv.restart_count,
                     "world_size": penv.world_size})

    def save_checkpoint(is_best: bool = False) -> checkpoint.Checkpoint | None:
        state.window_loss_sum, state.window_steps = float(loss_sum), loss_count
        rngs = gather_rng(penv.world_size)
        saved = None
        if sharded:  # every rank writes its optimizer shard into the temporary folder rank 0 made
            if main:
                checkpoint.begin(ckpt_root, state.step)
            dist.barrier()
            save_sharded_optimizer(model, optimizer, checkpoint.tmp_dir(ckpt_root, state.step))
            # gathered tied weights come back as separate tensors: keep the names the model checkpoints
            weights = {k: v for k, v in full_model_state(model).items() if k in shapes}
        else:
            weights = model_state(base) if main else {}
        if main:
            saved = checkpoint.save(
                ckpt_root,
                state.step,
                weights,
                {"optimizer": None if sharded else optimizer.state_dict(), "loader": loader.state_dict(),
                 "state": asdict(state), "rng": rngs},
                {"tokens": state.tokens, "train_loss": state.last_train_loss, "val_loss": state.last_val_loss,
                 "best_val_loss": state.best_val_loss, "config_hash": config_hash(cfg), "phase": phase,
                 "tokenizer": tokenizer_fingerprint(prepared), "world_size": penv.world_size},
                keep_last=cfg.checkpoint.keep_last,
                is_best=is_best,
                prepared=sharded,
            )
            runs.update_meta(path, step=state.step, tokens=state.tokens, last_checkpoint=saved.path.name,
                             best_val_loss=state.best_val_loss)
            if uploader:  # object storage: upload in the background
                uploader.submit(saved, is_best)
            if sinks:
                sinks.log({"kind": "checkpoint", "step": state.step, "path": str(saved.path), "best": is_best,
                           "phase": phase, "time": time.time()})
        dist.barrier()
        return saved

    def run_eval() -> bool:
        """Evaluate; True when this is the best validation loss so far."""
        if val_windows is None:
            return False
        val = evaluate(model, val_windows, cfg.train.micro_batch_size, cfg.eval.batches, device, amp,
                       penv.rank, penv.world_size)
        state.last_val_loss = val
        improved = state.best_val_loss is None or val < state.best_val_loss
        if improved:
            state.best_val_loss = val
        if sinks:
            sinks.log({"kind": "eval", "step": state.step, "val_loss": val, "val_ppl": perplexity(val),
                       "tokens": state.tokens, "phase": phase, "time": time.time()})
            _write_sample(path, base, tokenizer, cfg, state.step)
        return improved

    model.train()
    ddp_sync = getattr(model, "no_sync", None)
    fsdp_sync = getattr(model, "set_requires_gradient_sync", None)
    start_step = state.step
    status = "running"
    t_start = time.perf_counter()
    side_seconds = 0.0  # evaluation and checkpoints: not training throughput
    meter = Throughput()
    meter.tokens0 = state.tokens
    loss_sum = torch.tensor(state.window_loss_sum, device=device)
    loss_count = state.window_steps
    sample: str | None = None
    last_ckpt: checkpoint.Checkpoint | None = None
    try:
        with GracefulStop(cfg.checkpoint.grace_seconds) as stop:
            while state.step < max_steps:
                set_lr(optimizer, lr_at(state.step, cfg.train))
                for micro in range(cfg.train.grad_accum_steps):
                    batch = loader.next_batch().to(device)
                    last = micro == cfg.train.grad_accum_steps - 1
                    # Gradients are all-reduced once per optimizer step, on the last micro-batch.
                    if fsdp_sync is not None:
                        fsdp_sync(last)
                    sync = ddp_sync() if ddp_sync is not None and not last else contextlib.nullcontext()
                    with sync, amp():
                        loss = lm_loss(model(batch.input_ids), batch.labels) / cfg.train.grad_accum_steps
                    loss.backward()
                    loss_sum += loss.detach()
                if cfg.train.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                state.step += 1
                state.tokens += tokens_per_step
                loss_count += 1
                if sinks:
                    sinks.heartbeat(state.step)

                final = state.step >= max_steps
                if state.step % cfg.train.log_every_steps == 0 or final:
                    state.last_train_loss = float(dist.all_reduce_mean(loss_sum / loss_count))
                    loss_sum.zero_()
                    loss_count = 0
                    rate, _ = meter.window(state.tokens)
                    if sinks:
                        done = state.step - start_step
                        elapsed = time.perf_counter() - t_start
                        sinks.log({
                            "kind": "train", "step": state.step, "loss": state.last_train_loss,
                            "lr": optimizer.param_groups[0]["lr"], "tokens": state.tokens,
                            "tokens_per_second": rate,
                            "mfu": rate * flops_per_token / (peak * penv.world_size) if peak else None,
                            "memory_gib": memory_gib(device),
                            "eta_seconds": elapsed / done * (max_steps - state.step) if done else None,
                            "epoch": loader.epoch, "phase": phase, "time": time.time(),
                        })
                t_side = time.perf_counter()
                best = run_eval() if (state.step % cfg.eval.every_steps == 0 or final) else False
                stopping = dist.broadcast_flag(stop.requested, device)
                if best or final or stopping or state.step % cfg.checkpoint.every_steps == 0:
                    last_ckpt = save_checkpoint(is_best=best)
                side_seconds += time.perf_counter() - t_side
                if stopping:
                    stop.done()
                    status = "stopped"
                    raise TrainingStopped(
                        f"stopped by {stop.signal_name or 'a signal on another rank'} at step {state.step}; "
                        f"checkpoint saved, resume with the same command"
                    )
            status = "finished"
            t_end = time.perf_counter()
            if main and cfg.dist.strategy != "fsdp":
                sample = _sample_text(base, tokenizer, cfg, cfg.eval.sample_prompt or "\n", cfg.eval.sample_tokens * 3)
    except TrainingStopped:
        _finish(path, sinks, "stopped", state, main)
        raise
    except BaseException:
        _finish(path, sinks, "failed", state, main)
        raise
    finally:
        if uploader:  # object storage: wait for the uploads, within the grace period after a stop
            uploader.close(stop.time_left())
    _finish(path, sinks, status, state, main)
    elapsed = t_end - t_start - side_seconds
    return TrainResult(
        run_dir=str(path.resolve()),
        steps=state.step,
        tokens=state.tokens,
        final_train_loss=state.last_train_loss,
        final_val_loss=state.last_val_loss,
        best_val_loss=state.best_val_loss,
        tokens_per_second=(state.step - start_step) * tokens_per_step / elapsed if elapsed > 0 else 0.0,
        status=status,
        resumed_from=start_step if resumed is not None else None,
        sample=sample,
        checkpoint=str(last_ckpt.path.resolve()) if last_ckpt else None,
    )


def tokenizer_fingerprint(prepared: Any) -> str:
    return str(prepared.meta["tokenizer"])


def _resume(mode: str, ckpt_root: Path, path: Path, cfg: Config, say: Log) -> checkpoint.Checkpoint | None:
    if mode == "auto":
        return checkpoint.find_resumable(ckpt_root, warn=lambda m: say(f"warning: {m}"))
    target = Path(mode)
    if not target.exists():
        raise UserInputError(f"--resume: no such checkpoint or run directory: {mode}")
    return checkpoint.resolve(target)


def _finish(path: Path, sinks: Any, status: str, state: TrainState, main: bool) -> None:
    # meta.json first: sinks (MLflow) keep it as an artifact, and it should say how the run ended
    if main and path.exists():
        runs.update_meta(path, status=status, step=state.step, tokens=state.tokens,
                         best_val_loss=state.best_val_loss, final_val_loss=state.last_val_loss,
                         final_train_loss=state.last_train_loss, finished_at=time.time())
    if sinks:
        sinks.finish(status)


def _sample_text(model: nn.Module, tokenizer: Any, cfg: Config, prompt: str, n: int) -> str:
    ids = tokenizer.encode(prompt)
    out = generate(model, ids, n, cfg.model.block_size, temperature=0.8, top_k=50,
                   eos_id=tokenizer.eos_id, seed=cfg.run.seed)
    return prompt + tokenizer.decode(out)


def _write_sample(path: Path, model: nn.Module, tokenizer: Any, cfg: Config, step: int) -> None:
    if cfg.eval.sample_prompt is None or cfg.dist.strategy == "fsdp":
        return
    text = _sample_text(model, tokenizer, cfg, cfg.eval.sample_prompt, cfg.eval.sample_tokens)
    with open(path / runs.SAMPLES_FILE, "a", encoding="utf-8") as f:
        f.write(json.dumps({"step": step, "sample": text}) + "\n")


"""The training spine: a Trainer that sets up, steps, evaluates, saves and finishes; `train` runs one to the end."""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kubetrain import checkpoint, hardware, runs
from kubetrain.checkpoint import remote
from kubetrain.config.schema import Config
from kubetrain.data.loader import TokenWindows, TrainLoader, counted_tokens
from kubetrain.data.shards import Prepared, prepare
from kubetrain.distributed import setup as dist
from kubetrain.errors import CheckpointError, TrainingFailed, TrainingStopped, resume_hint
from kubetrain.track import Fanout
from kubetrain.track.build import build_sinks
from kubetrain.track.console import console_log, count
from kubetrain.track.jsonl import truncate_after
from kubetrain.train.accumulation import Window
from kubetrain.train.checkpointing import Checkpointer, tokenizer_fingerprint
from kubetrain.train.clock import RunClock
from kubetrain.train.device import (
    MemoryPeak,
    apply_torch_settings,
    autocast,
    device_name,
    is_out_of_memory,
    model_flops_per_token,
    out_of_memory_advice,
    peak_flops,
    select_device,
)
from kubetrain.train.evaluate import evaluate, perplexity
from kubetrain.train.heartbeat import Heartbeat
from kubetrain.train.launch_plan import plan_worker
from kubetrain.train.loss import loss_step
from kubetrain.train.loss_window import LossWindow
from kubetrain.train.memory_check import report_peak
from kubetrain.train.micro_batch import MicroBatchChoice, confirm_on_model
from kubetrain.train.model_for_world import build_model_for_world
from kubetrain.train.nonfinite import NonFiniteGuard
from kubetrain.train.optim import build_optimizer, lr_at, set_lr
from kubetrain.train.profile import StepProfiler
from kubetrain.train.result import TrainResult, record_end
from kubetrain.train.samples import Samples
from kubetrain.train.state import TrainState, load_optimizer, unwrap, weight_shapes
from kubetrain.train.stop import GracefulStop, StopVote
from kubetrain.train.straggler import ComputeTimer

Log = Callable[[str], None]


@dataclass
class RunOptions:
    """How one call trains a config: where it resumes from, what it starts from, which phase it is."""

    argv: list[str] | None = None
    resume: str = "auto"  # auto | never | a checkpoint or run directory
    dry_run: bool = False
    run_path: Path | None = None  # default: the config's run directory
    init_weights: Path | None = None  # start from these weights (a phase chained to the previous one)
    init_optimizer: bool = False
    phase: str | None = None
    micro_batch: MicroBatchChoice | None = None  # micro_batch_size auto: the estimate's choice; setup confirms it
    device: torch.device | None = None  # the launch plan's (None: chosen here, for a Trainer made on its own)


def train(cfg: Config, *, log: Log | None = None, **options: Any) -> TrainResult:
    """Train `cfg` to the end (or until stopped), resuming from the run's checkpoints when there are some.

    Under a launcher this joins the process group; the caller tears it down (phases share one group).
    """
    plan = plan_worker(cfg)  # the device, this process's place, micro_batch_size auto -> an int, the memory verdict
    plan.refuse_what_does_not_fit()  # before the model is built: this process's share (a launcher checked the node)
    return Trainer(plan.cfg, RunOptions(**options, micro_batch=plan.micro_batch, device=plan.device), log=log).run()


class Trainer:
    """One run of a config. `run` is the spine; each other method is one part of it, usable on its own.

    Saving and resuming are its checkpointer's (train/checkpointing.py), given the parts it saves.
    """

    # setup(): data and model
    prepared: Prepared
    tokenizer: Any
    train_windows: TokenWindows
    val_windows: TokenWindows | None
    model: nn.Module
    base: nn.Module  # the single-device model (no DDP/FSDP/compile wrapper): what checkpoints and samples use
    max_steps: int
    tokens_per_step: int
    # open(): the run directory, optimizer and loop state
    path: Path
    loader: TrainLoader
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    checkpointer: Checkpointer
    sinks: Fanout | None = None
    uploader: remote.Uploader | None = None  # rank 0, with checkpoint.uri: copies checkpoints to object storage

    def __init__(self, cfg: Config, opts: RunOptions | None = None, log: Log | None = None) -> None:
        self.cfg, self.opts = cfg, opts or RunOptions()
        self.device = self.opts.device if self.opts.device is not None else select_device(cfg.run.device)
        self.torch_settings = apply_torch_settings(cfg, self.device)  # before the first CUDA kernel
        self.penv = dist.init(cfg.dist, self.device)
        self.main = self.penv.is_main
        self.prefix = f"[rank {self.penv.rank}] " if self.penv.distributed else ""
        self.out: Log = log or console_log(self.prefix)
        self.say: Log = self.out if self.main else (lambda m: None)
        self.sharded = self.penv.distributed and cfg.dist.shards_weights  # FSDP or HSDP
        self.state = TrainState()
        self.evaluated_step = -1  # the step of the last evaluation: only a checkpoint of that step can be `best`
        self.heartbeat = Heartbeat.from_env(self.penv.rank)  # under the launcher: what its hang watch reads

    def run(self) -> TrainResult:
        """Set up, then step until max_steps: log, evaluate and checkpoint when due; stop cleanly on a signal."""
        with self.out_of_memory_is_one_line("while setting up"):
            self.setup()
            if self.opts.dry_run:
                return self.dry_run()
            self.open()
        cfg, state = self.cfg, self.state
        status, sample = "failed", None
        finite = True  # no step being skipped (not finite) at the last step
        stop = GracefulStop(cfg.checkpoint.grace_seconds, self.ckpt_root)
        vote = StopVote.for_world()  # every rank stops at the same step, with no GPU sync per step
        profiler = StepProfiler.for_rank(cfg.train.profile, self.path, self.penv.rank, self.device, state.step,
                                         self.out, self.penv.world_size)  # train.profile: rank 0 by default
        try:
            with stop, self.out_of_memory_is_one_line(None):
                while state.step < self.max_steps:
                    self.train_step()
                    if profiler:
                        profiler.step(state.step)
                    if state.step == self.start_step + 1:  # start-up is behind us: the short timeout from now on
                        dist.use_step_timeout(cfg.dist, self.device)
                        self.first_step_done()
                    if state.step == self.start_step + 2 and self.device.type == "cuda":
                        report_peak(cfg, self.device, self.out)  # the optimizer's state exists from step 1's end
                    self.checkpointer.collect_saves()  # a background save that finished: its record, or its error
                    final = state.step >= self.max_steps
                    if state.step % cfg.train.log_every_steps == 0 or final:
                        self.log_train()
                    with self.clock.side_work():
                        # steps being skipped (not finite): no evaluation and no periodic save while it lasts; the
                        # run stops if it lasts max_nonfinite_steps. The end of the run and a stop save anyway: a
                        # skipped step changed no weight.
                        finite = self.guard.finite(state.step, final)
                        improved = finite and (state.step % cfg.eval.every_steps == 0 or final) and self.evaluate()
                        stopping = vote.poll(stop.requested)
                        finite = self.guard.finite(state.step, last=True) if stopping else finite
                        if final or stopping or (finite and (state.step % cfg.checkpoint.every_steps == 0
                                                             or (improved and cfg.checkpoint.save_best))):
                            if not finite:
                                self.say_saved_while_skipping()
                            self.save(background=not (final or stopping))
                    if stopping:
                        vote.close()
                        stop.done()
                        status = "stopped"
                        saved = self.last_checkpoint.path.name if self.last_checkpoint else "saved"  # rank 0's
                        raise TrainingStopped(f"stopped by {stop.signal_name or 'a signal on another rank'} at "
                                              f"step {state.step}; checkpoint {saved}; {resume_hint()}")
                vote.close()
                self.clock.stop()
                # weights whose last loss was not finite may sample NaN: no sample of them (nor an evaluation)
                sample = self.samples.at_end(self.say) if finite else None
                status = "finished"
        except OSError as e:  # bad input was refused before the first step: this is the machine, not the config
            where = f": {e.filename}" if e.filename else ""
            raise TrainingFailed(f"failed while running at step {state.step}: {e.strerror or e}{where}") from e
        finally:
            if profiler:
                profiler.close()
            with contextlib.suppress(CheckpointError):  # a failure elsewhere: keep what is being written
                self.checkpointer.wait_for_saves(stop.time_left())  # (a failed shard is already reported on rank 0)
            self.checkpointer.close()
            if self.uploader:  # wait for the uploads; after a stop, only within what is left of the grace period
                self.uploader.close(stop.time_left())
            self.finish(status)
        return TrainResult.of_run(self.path, state, status, start_step=self.start_step,
                                  resumed=self.resumed is not None, sample=sample, last_checkpoint=self.last_checkpoint,
                                  trained_tokens=(state.step - self.start_step) * self.tokens_per_step,
                                  training_seconds=self.clock.training_seconds())

    def first_step_done(self) -> None:
        """The first step compiled and warmed up: its time counts in the run's, not in tokens/s nor the ETA's rate
        (train/clock.py); the first logging window's clock starts after it, unless that step is the whole window."""
        step = self.state.step
        seconds = self.clock.first_step_done(self.state.tokens, bool(step % self.cfg.train.log_every_steps)
                                             and step < self.max_steps)
        if self.compile.enabled:
            self.say(f"first step (compiling) took {seconds:.1f} s")

    @contextlib.contextmanager
    def out_of_memory_is_one_line(self, where: str | None) -> Iterator[None]:
        """Out of memory is one line naming what to change, exit 1. `where`: None for "after step N" (the loop)."""
        try:
            yield
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not is_out_of_memory(e):
                raise
            where = where or f"after step {self.state.step}"
            raise TrainingFailed(out_of_memory_advice(self.cfg, self.device.type, where,
                                                      self.penv.world_size)) from e

    # --- setup: everything a dry run needs too -------------------------------------------------------------

    def setup(self) -> None:
        """Data (every rank tokenizes a share, through the cache folder, never in a collective), model, steps."""
        cfg, penv = self.cfg, self.penv
        need = cfg.model.block_size + 1
        self.prepared = prepare(cfg, min_tokens=need, log=self.say, first=penv.rank)
        if penv.distributed:
            self.out(f"process {penv.rank}/{penv.world_size} on {self.device} (local rank {penv.local_rank})")
        prepared = self.prepared
        self.tokenizer = prepared.tokenizer()
        self.train_windows = TokenWindows(prepared, "train", cfg.model.block_size)
        self.val_windows = TokenWindows(prepared, "val", cfg.model.block_size) if prepared.n_val > need else None

        # the precision first: a frozen Hugging Face base (LoRA) loads straight in it (model.dtype auto)
        choice = hardware.choose_precision(cfg.train.precision, hardware.accelerator(self.device))
        if choice.warning:
            self.say(f"warning: {choice.warning}")
        self.precision = choice.name
        self.compile = hardware.compile_choice(cfg.train.compile, self.device)
        self.model = build_model_for_world(cfg, self.tokenizer.vocab_size, self.device, self.precision, penv,
                                           compiled=self.compile.enabled)
        self.base = unwrap(self.model)
        # (input_ids, labels) -> summed loss: the model and its loss in one compiled graph when compiling
        self.loss_of = loss_step(self.model, self.compile.enabled, blocks_compiled=self.sharded)
        if self.opts.micro_batch is not None:  # one training step confirms it, stepping down on out-of-memory
            cfg, line = confirm_on_model(cfg, self.opts.micro_batch, self.model, self.train_windows, self.device,
                                         autocast(self.precision, self.device, self.sharded), penv.world_size,
                                         self.opts.dry_run, self.loss_of)
            self.cfg = cfg
            self.say(line)
        n_params = sum(p.numel() for p in self.model.parameters())
        n_trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        self.n_params = n_params
        t = cfg.train
        self.tokens_per_step = t.micro_batch * t.grad_accum_steps * penv.world_size * cfg.model.block_size
        self.max_steps = t.max_steps
        if t.max_tokens:
            self.max_steps = min(self.max_steps, math.ceil(t.max_tokens / self.tokens_per_step))
        self.amp = autocast(self.precision, self.device, self.sharded)  # none under FSDP's policy
        self.samples = Samples(cfg, self.base, self.tokenizer, self.amp, self.main, self.sharded)
        # frozen weights (LoRA's base) get no weight gradient: counted, not assumed (device.py)
        self.flops_per_token = model_flops_per_token(self.base, cfg.model.block_size)
        self.peak = peak_flops(self.device, self.precision, self.torch_settings.tf32)
        self.say(
            f"model: {count(n_params)} parameters ({count(n_trainable)} trainable) | "
            f"device {self.device.type} x{penv.world_size} | precision {self.precision}"
        )
        self.say(self.compile.line())
        self.say(
            f"tokens per step: {self.tokens_per_step:,} ({t.micro_batch} seq x {cfg.model.block_size} tok x "
            f"{t.grad_accum_steps} accum x {penv.world_size} ranks) | steps {self.max_steps} | "
            f"data {prepared.n_train:,} train / {prepared.n_val:,} val tokens ({self.tokenizer.kind} tokenizer)"
        )

    def dry_run(self) -> TrainResult:
        """One forward pass on the first batch; nothing is written."""
        cfg = self.cfg
        batch = TrainLoader(self.train_windows, cfg.train.micro_batch, cfg.run.seed).next_batch().to(self.device)
        with torch.no_grad(), self.amp():  # the training step's own loss: never the whole logits
            first_loss = float(self.loss_of(batch.input_ids, batch.labels, batch.position_ids)
                               / counted_tokens(batch.labels).clamp(min=1))
        self.say(f"dry run: one forward pass, loss {first_loss:.4f} (ln(vocab) = "
                 f"{math.log(self.tokenizer.vocab_size):.4f}); no run directory was written")
        return TrainResult("", 0, 0, first_loss, None, None, 0.0, "dry-run")

    # --- open: the run directory, resume, wrapping, optimizer, sinks ----------------------------------------

    def open(self) -> None:
        """Resume or start the run directory, build the optimizer and sinks."""
        cfg, penv = self.cfg, self.penv
        self.path = self.opts.run_path or runs.run_dir(cfg)
        self.ckpt_root = self.path / runs.CHECKPOINTS
        self.loader = TrainLoader(self.train_windows, cfg.train.micro_batch, cfg.run.seed, penv.rank,
                                  penv.world_size)
        self.shapes = weight_shapes(self.base)
        self.checkpointer = Checkpointer(cfg, self.path, penv, self.device, sharded=self.sharded,
                                         phase=self.opts.phase, tokenizer=tokenizer_fingerprint(self.prepared),
                                         shapes=self.shapes, say=self.say)
        source = self.checkpointer.restore_weights(self.base, self.opts.resume, self.opts.init_weights)
        # Built on the parallelized model's parameters (FSDP's are shards), its state loaded after.
        self.optimizer = build_optimizer(self.model, cfg.train, self.device)
        # fp16 gradients underflow without loss scaling; bf16 and fp32 need none (the scaler is then a no-op)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")
        if self.resumed is not None:
            self.state = self.checkpointer.restore_trainer(self.resumed, self.model, self.optimizer, self.loader,
                                                           self.scaler)
        elif source is not None:
            if self.opts.init_optimizer:
                load_optimizer(self.model, self.optimizer, source, source.trainer_state(), self.sharded)
            self.say(f"starting from the weights{' and optimizer state' if self.opts.init_optimizer else ''} "
                     f"of {source.path}")
        self.start_run_files()
        self.model.train()
        self.start_step = self.state.step
        self.compute_timer = ComputeTimer(self.device, self.base)  # stragglers: data wait + forward per rank
        self.checkpointer.attach(self.model, self.base, self.optimizer, self.loader, self.scaler, self.sinks,
                                 self.uploader)
        self.memory_peak = MemoryPeak(self.device)
        self.guard = NonFiniteGuard(cfg, self.device, self.ckpt_root, self.checkpointer.wait_for_saves, self.state)
        self.clock = RunClock(self.start_step, self.state.tokens)  # tokens/s, the ETA, the result's training time
        self.logged_loss = LossWindow(self.device, self.state, resumes=self.main)

    def start_run_files(self) -> None:
        """Rank 0: meta.json, metrics and samples cut back to the resumed step, the tokenizer, the sinks."""
        if not self.main:
            return
        cfg, path, step = self.cfg, self.path, self.state.step
        argv = self.opts.argv if self.opts.argv is not None else sys.argv[1:]
        meta = runs.start(path, cfg, argv, self.penv.world_size, phase=self.opts.phase,
                          restart=self.penv.restart_count)
        runs.update_meta(path, device=device_name(self.device), peak_flops=self.peak)  # what MFU is measured against
        for change in meta["config_changes"]:
            self.say(f"config changed since the last start: {change}")
        for name in (runs.METRICS_FILE, runs.SAMPLES_FILE):
            truncate_after(path / name, step, lambda message: self.say(f"warning: {message}"))
        self.tokenizer.save(path / "tokenizer")
        self.sinks = build_sinks(cfg, path, self.max_steps, prefix=self.prefix)
        self.uploader = remote.Uploader.from_config(cfg, self.opts.phase, self.ckpt_root, self.say)
        self.sinks.start({"run_dir": str(path), "run": cfg.run.name, "start_step": step, "params": self.n_params,
                          "phase": self.opts.phase, "config": cfg, "max_steps": self.max_steps,
                          "restarts": self.penv.restart_count, "world_size": self.penv.world_size,
                          # what the resumed checkpoint holds: the gauges read it back before the next save/eval
                          "last_checkpoint_step": self.resumed.step if self.resumed else None,
                          "val_loss": self.state.last_val_loss})

    # --- the parts of a step ---------------------------------------------------------------------------------

    def train_step(self) -> None:
        """One optimizer step over the accumulation window: its loss is the sum over the window's micro-batches and
        every rank over their counted tokens (train/accumulation.py); gradients all-reduced on the last micro-batch.
        A step whose loss or gradients are not finite, or whose window counted no token, changes nothing
        (train/nonfinite.py); it still counts as a step, so the data and the LR schedule stay where they would be."""
        accum = self.cfg.train.grad_accum_steps
        model = self.model
        # DDP all-reduces only the last micro-batch. FSDP reduce-scatters every one (torchtitan does too): skipping
        # it would keep unsharded gradients, the whole model's, between micro-batches.
        no_grad_sync = getattr(model, "no_sync", None)
        set_lr(self.optimizer, lr_at(self.state.step, self.cfg.train, self.max_steps))
        self.compute_timer.start()
        window = Window.fetch(self.loader, accum, self.device, self.penv.world_size)  # its count's all-reduce starts
        self.compute_timer.batch_ready()
        for micro, batch in enumerate(window.batches):
            last = micro == accum - 1
            sync = no_grad_sync() if no_grad_sync is not None and not last else contextlib.nullcontext()
            with sync, self.amp():
                loss_sum = self.loss_of(batch.input_ids, batch.labels, batch.position_ids)
            self.compute_timer.stop()
            self.scaler.scale(self.guard.loss_to_backward(loss_sum, window.loss_scale())).backward()
            self.logged_loss.add(loss_sum)
        self.logged_loss.step_done(window.counted)
        self.checkpointer.wait_for_staging()  # a background save copies the weights until here; the optimizer
        # changes them
        self.guard.step(self.optimizer, self.scaler, model.parameters(), window.empty())
        self.memory_peak.sample()  # CPU: resident memory with gradients and optimizer state in place
        self.optimizer.zero_grad(set_to_none=True)
        self.state.step += 1
        self.state.tokens += self.tokens_per_step
        if self.sinks:
            self.sinks.heartbeat(self.state.step)
        if self.heartbeat:
            self.heartbeat.beat(self.state.step)

    def say_saved_while_skipping(self) -> None:
        """The line of a last save (the end, a stop) made while steps are being skipped: whose weights it holds."""
        step, n = self.state.step, self.guard.streak_seen
        self.say(f"warning: the last {n} step{'s' if n > 1 else ''} (to step {step}) changed no weight: "
                 f"the loss or its gradients were not finite (NaN or inf); step {step}'s checkpoint holds the "
                 f"weights of step {step - n}, not evaluated")

    def save(self, is_best: bool | None = None, background: bool = False) -> checkpoint.Checkpoint | None:
        """A checkpoint of this step (collective: every rank calls it); rank 0 gets it back (None in the background).

        `best` moves only among saved checkpoints: to this one when it was evaluated at this step with a lower
        val loss than every saved one (`is_best` overrides that).
        """
        state = self.state
        self.guard.count_into(state)
        if not self.guard.savable(self.model, self.optimizer, state.step, last=not background, say=self.say):
            return None  # an update overflowed: the next step's loss is not finite, and the guard counts it
        if is_best is None:
            is_best = state.improves_best_saved(self.evaluated_step)
        if is_best:
            state.best_saved_val_loss = state.last_val_loss
        self.logged_loss.save_into(state)
        return self.checkpointer.save(state, is_best, background)

    @property
    def resumed(self) -> checkpoint.Checkpoint | None:
        return self.checkpointer.resumed

    @property
    def last_checkpoint(self) -> checkpoint.Checkpoint | None:
        return self.checkpointer.last_checkpoint

    def log_train(self) -> None:
        """The loss of the window since the last log (its summed loss over its counted tokens, every rank's),
        throughput, MFU, memory, ETA."""
        state = self.state
        self.guard.count_into(state)  # a host sync: here only
        state.last_train_loss = self.logged_loss.read_and_reset()
        rate = self.clock.window(state.tokens)
        stragglers = self.compute_timer.gather()  # one all_gather, at log steps only
        if not self.sinks:
            return
        self.sinks.log({
            "kind": "train", "step": state.step, "loss": state.last_train_loss,
            "lr": self.optimizer.param_groups[0]["lr"], "tokens": state.tokens, "tokens_per_second": rate,
            "mfu": rate * self.flops_per_token / (self.peak * self.penv.world_size) if self.peak else None,
            "memory_gib": self.memory_peak.read_and_reset(),  # the peak since the previous log line
            "eta_seconds": self.clock.eta(state.step, self.max_steps),
            "epoch": self.loader.epoch, "phase": self.opts.phase, "time": time.time(),
            "skipped_steps": state.skipped_steps, "empty_steps": state.empty_steps,
            **({"loss_scale": self.scaler.get_scale()} if self.scaler.is_enabled() else {}),
            **(stragglers.record() if stragglers else {}),
            **({"upload_failures": len(self.uploader.failed)} if self.uploader else {}),
        })

    def evaluate(self) -> bool:
        """Validation loss on every rank (and a sample on rank 0); True when it is the best so far."""
        if self.val_windows is None:
            return False
        cfg, state = self.cfg, self.state
        val = evaluate(self.model, self.val_windows, cfg.train.micro_batch, cfg.eval.windows, self.device,
                       self.amp, self.penv.rank, self.penv.world_size, self.loss_of)
        state.last_val_loss, self.evaluated_step = val, state.step
        improved = state.best_val_loss is None or val < state.best_val_loss
        if improved:
            state.best_val_loss = val
        if self.sinks:
            self.sinks.log({"kind": "eval", "step": state.step, "val_loss": val, "val_ppl": perplexity(val),
                            "tokens": state.tokens, "phase": self.opts.phase, "time": time.time()})
        self.samples.write(self.path, state.step)
        return improved

    def finish(self, status: str) -> None:
        """Record how the run ended: meta.json first (sinks such as MLflow keep it as an artifact), then sinks."""
        if self.main:
            record_end(self.path, self.state, status, self.say)
        if self.sinks:
            self.sinks.finish(status)
        if self.heartbeat:
            self.heartbeat.close(clean=status in ("finished", "stopped"))

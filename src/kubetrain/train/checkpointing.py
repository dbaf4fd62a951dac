"""What the Trainer writes into a checkpoint and reads back: save one of this step (every rank), record it once
written (meta.json, the upload, its metrics.jsonl line; rank 0), and resume from one."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kubetrain import checkpoint, runs
from kubetrain.checkpoint import remote, restore
from kubetrain.checkpoint.sharded import full_model_state, save_optimizer_in_background
from kubetrain.checkpoint.sharded import save_optimizer as save_sharded_optimizer
from kubetrain.config.loading import config_hash
from kubetrain.config.schema import Config
from kubetrain.data.loader import TrainLoader
from kubetrain.data.shards import Prepared
from kubetrain.distributed import parallelize
from kubetrain.distributed import setup as dist
from kubetrain.distributed.env import ProcessEnv
from kubetrain.errors import CheckpointError, IncompatibleCheckpointError, UserInputError
from kubetrain.track import Fanout
from kubetrain.track.console import checkpoint_line
from kubetrain.train.state import (
    TrainState,
    gather_rng,
    load_model_state,
    load_optimizer,
    model_state,
    optimizer_steps,
    set_rng_state,
)

if TYPE_CHECKING:
    from kubetrain.train.trainer import RunOptions


def tokenizer_fingerprint(prepared: Prepared) -> str:
    """What a checkpoint records of its tokenizer, and what a resume compares."""
    return str(prepared.meta["tokenizer"])


class Checkpointing:
    """The checkpoint side of the Trainer (a base class of it): what it reads is set up by Trainer.setup and open."""

    cfg: Config
    opts: RunOptions
    penv: ProcessEnv
    main: bool
    sharded: bool
    state: TrainState
    prepared: Prepared
    model: nn.Module
    base: nn.Module
    shapes: dict[str, list[int]]
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    loader: TrainLoader
    path: Path
    ckpt_root: Path
    loss_sum: torch.Tensor
    loss_count: int
    evaluated_step: int
    counted_at: tuple[int, int]
    resumed: checkpoint.Checkpoint | None
    last_checkpoint: checkpoint.Checkpoint | None
    sinks: Fanout | None
    uploader: remote.Uploader | None
    saver: checkpoint.BackgroundSaver | None
    checkpoint_group: torch.distributed.ProcessGroup | None  # FSDP + async_save: background writes' collectives
    shards_written: Future[Any] | None  # FSDP + async_save, ranks but 0: this rank's optimizer shard being written
    say: Callable[[str], None]

    # --- save -----------------------------------------------------------------------------------------------

    def save(self, is_best: bool | None = None, background: bool = False) -> checkpoint.Checkpoint | None:
        """A checkpoint of this step (collective: every rank calls it); rank 0 gets it back.

        `best` moves only among saved checkpoints: to this one when it was evaluated at this step with a lower
        val loss than every saved one (`is_best` overrides that). `background` (with checkpoint.async_save):
        staged to host memory and written by a thread; None comes back and `collect_saves` records it once
        written. Under FSDP every rank also copies its optimizer shard to host memory and DCP writes it in the
        background; rank 0 finishes the checkpoint once all shards are written. The save in flight is waited
        for first, on every rank.
        """
        state, cfg = self.state, self.cfg
        t0 = time.perf_counter()
        # One save at a time, on every rank: `latest` moves in step order, and the previous save's prune (which
        # removes `*.tmp` leftovers) is over before this save's temporary folder is made.
        self.wait_for_saves()
        self.count_skipped_steps()
        if is_best is None:
            is_best = self.evaluated_step == state.step and state.last_val_loss is not None and (
                state.best_saved_val_loss is None or state.last_val_loss < state.best_saved_val_loss)
        if is_best:
            state.best_saved_val_loss = state.last_val_loss
        state.window_loss_sum, state.window_steps = float(self.loss_sum), self.loss_count
        rngs = gather_rng(self.penv.world_size)
        saved, shards = None, None
        if self.sharded:  # every rank writes its optimizer shard into the temporary folder rank 0 made
            # The weights first: a collective of the training group, so on this thread; done before DCP's write
            # thread starts, which would compete with it for the CPU. Gathered tied weights come back as separate
            # tensors: keep the names the model checkpoints.
            weights = {k: v for k, v in full_model_state(self.model).items() if k in self.shapes}
            if self.main:
                checkpoint.begin(self.ckpt_root, state.step)
            dist.barrier()
            folder = checkpoint.tmp_dir(self.ckpt_root, state.step)
            if background and self.checkpoint_group is not None:
                shards = save_optimizer_in_background(self.model, self.optimizer, folder, self.checkpoint_group)
                if not self.main:  # rank 0's writer thread waits for it, then finishes the checkpoint
                    self.shards_written = shards
            else:
                save_sharded_optimizer(self.model, self.optimizer, folder)
        else:
            weights = model_state(self.base) if self.main else {}
        if self.main:
            trainer = {"optimizer": None if self.sharded else self.optimizer.state_dict(),
                       "loader": self.loader.state_dict(), "state": asdict(state), "rng": rngs,
                       "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None}
            meta = {"tokens": state.tokens, "train_loss": state.last_train_loss, "val_loss": state.last_val_loss,
                    "best_val_loss": state.best_val_loss, "config_hash": config_hash(cfg), "phase": self.opts.phase,
                    "tokenizer": tokenizer_fingerprint(self.prepared), "world_size": self.penv.world_size}
            if self.saver is not None and background:  # staged to host memory here, written in the background
                self.saver.save(self.ckpt_root, state.step, weights, trainer, meta, keep_last=cfg.checkpoint.keep_last,
                                is_best=is_best, waited=time.perf_counter() - t0, shards=shards)
            else:
                self.collect_saves()  # the one that was in flight: recorded before this one
                saved = checkpoint.save(self.ckpt_root, state.step, weights, trainer, meta,
                                        keep_last=cfg.checkpoint.keep_last, is_best=is_best, prepared=self.sharded)
                seconds = time.perf_counter() - t0
                self.saved(checkpoint.Saved(saved, is_best, seconds, seconds))
        dist.barrier()
        return saved

    def wait_for_saves(self, timeout: float | None = None) -> bool:
        """Every rank: wait (at most `timeout` seconds) for the save in flight; True when none is left.

        Rank 0 waits for its writer thread (which waits for every rank's shard); the other ranks for their shard.
        A shard that failed to write fails the run here, on its rank, as rank 0's writer fails it on rank 0.
        """
        if self.saver is not None:
            return self.saver.wait(timeout)
        shards = self.shards_written
        if shards is None:
            return True
        try:
            shards.result(timeout)
        except TimeoutError:
            return False
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            self.shards_written = None
            raise CheckpointError(f"could not write this rank's optimizer shard of a checkpoint in {self.ckpt_root}: "
                                  f"{str(e).splitlines()[0]}") from None
        self.shards_written = None
        return True

    def collect_saves(self, wait: bool = False) -> None:
        """Rank 0: record the background saves that finished (waiting for the one in flight when asked)."""
        if self.saver is None:
            return
        if wait:
            self.saver.wait()
        for done in self.saver.collect():
            self.saved(done)

    def saved(self, done: checkpoint.Saved) -> None:
        """A checkpoint is complete: meta.json, the upload, its line in metrics.jsonl."""
        saved = done.checkpoint
        runs.update_meta(self.path, step=saved.meta["step"], tokens=saved.meta["tokens"],
                         last_checkpoint=saved.path.name, best_val_loss=saved.meta["best_val_loss"])
        if self.uploader:  # in the background: training goes on while it uploads
            self.uploader.submit(saved, done.is_best)
        # k8s doctor reads the save time back from the pod's log
        self.say(checkpoint_line(saved.meta["step"], done.write_seconds, done.blocked_seconds))
        if self.sinks:
            self.sinks.log({"kind": "checkpoint", "step": saved.meta["step"], "path": str(saved.path),
                            "best": done.is_best, "blocked_seconds": round(done.blocked_seconds, 4),
                            "write_seconds": round(done.write_seconds, 4), "phase": self.opts.phase,
                            "time": time.time()})
        self.last_checkpoint = saved

    def count_skipped_steps(self) -> None:
        """fp16: add the steps since the last count that the scaler skipped (inf/nan gradients).

        Read from the optimizer's own step counter at log and save time only: comparing the loss scale before
        and after every step (scaler.get_scale) synchronised the host with the GPU twice per step.
        """
        if not self.scaler.is_enabled():
            return
        taken = optimizer_steps(self.optimizer)
        steps, last_taken = self.state.step - self.counted_at[0], taken - self.counted_at[1]
        self.state.skipped_steps += steps - last_taken
        self.counted_at = (self.state.step, taken)

    # --- resume ---------------------------------------------------------------------------------------------

    def restore_weights(self) -> checkpoint.Checkpoint | None:
        """Load the checkpoint to resume from (or the initial weights) into the single-device model."""
        mode = self.opts.resume
        if mode == "never" and checkpoint.complete_checkpoints(self.ckpt_root):
            raise UserInputError(
                f"{self.path} already has checkpoints; resume it (--resume auto), or choose another run.name"
            )
        if mode == "auto":  # a local folder without checkpoints resumes from object storage: one process
            # per folder downloads, the others wait on the folder (no collective)
            restore.restore_once(self.cfg, self.opts.phase, self.ckpt_root, self.say)
            self.resumed = checkpoint.find_resumable(self.ckpt_root, warn=lambda m: self.say(f"warning: {m}"))
        elif mode != "never":
            if not Path(mode).exists():
                raise UserInputError(f"--resume: no such checkpoint or run directory: {mode}")
            self.resumed = checkpoint.resolve(Path(mode))
        init = self.opts.init_weights
        source = self.resumed or (checkpoint.resolve(init) if init is not None else None)
        if source is not None:
            checkpoint.check_compatible(source, self.shapes, tokenizer_fingerprint(self.prepared))
            if parallelize.is_sharded(self.base):  # each rank reads only the bytes of its shards
                parallelize.load_safetensors(self.base, [source.path / checkpoint.MODEL_FILE])
            else:
                load_model_state(self.base, source.model_state())
        return source

    def restore_trainer(self, ckpt: checkpoint.Checkpoint) -> None:
        """Optimizer, data cursor, counters and RNG streams of the checkpoint we resume."""
        trainer = ckpt.trainer_state()
        load_optimizer(self.model, self.optimizer, ckpt, trainer, self.sharded)
        try:
            self.loader.load_state_dict(trainer["loader"])
        except ValueError as e:
            raise IncompatibleCheckpointError(f"cannot resume {ckpt.path}: {e}") from None
        self.state = TrainState(**trainer["state"])
        if "best_saved_val_loss" not in trainer["state"]:  # saved when every improvement was saved, as `best`
            self.state.best_saved_val_loss = self.state.best_val_loss
        if self.scaler.is_enabled() and trainer.get("scaler"):
            self.scaler.load_state_dict(trainer["scaler"])
        rngs = trainer["rng"]
        if len(rngs) == self.penv.world_size:
            set_rng_state(rngs[self.penv.rank])
        else:
            self.say(f"note: the checkpoint has RNG states of {len(rngs)} ranks, this run has {self.penv.world_size}")
        self.say(f"resuming from {ckpt.path} (step {self.state.step}, {self.state.tokens:,} tokens)")

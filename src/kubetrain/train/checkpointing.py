"""The checkpointer of a run (torchtitan's CheckpointManager): save one of this step (every rank), record it once
written (meta.json, the upload, its metrics.jsonl line; rank 0), and resume from one. Its inputs are explicit
(the config, the run directory, the model, optimizer, loader and scaler it saves); it knows nothing of the Trainer."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kubetrain import checkpoint, runs
from kubetrain.checkpoint import remote, restore
from kubetrain.checkpoint.sharded import ShardSaver, load_model_shards, save_shards
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
    set_rng_state,
)


def tokenizer_fingerprint(prepared: Prepared) -> str:
    """What a checkpoint records of its tokenizer, and what a resume compares."""
    return str(prepared.meta["tokenizer"])


class Checkpointer:
    """Saves and resumes the checkpoints of one run directory, on every rank (rank 0 alone writes run files).

    Made before the model is wrapped (`restore_weights` loads into the single-device or sharded model); `attach`
    gives it what a save holds once the optimizer exists. Under FSDP every rank writes its own shards; with
    checkpoint.async_save saves are written in the background, one at a time.
    """

    def __init__(self, cfg: Config, run_dir: Path, penv: ProcessEnv, device: torch.device, *, sharded: bool,
                 phase: str | None, tokenizer: str, shapes: dict[str, list[int]], say: Callable[[str], None]) -> None:
        self.cfg, self.run_dir, self.penv, self.device = cfg, run_dir, penv, device
        self.root = run_dir / runs.CHECKPOINTS
        self.main, self.sharded, self.phase = penv.is_main, sharded, phase
        self.tokenizer, self.shapes, self.say = tokenizer, shapes, say
        self.resumed: checkpoint.Checkpoint | None = None
        self.last_checkpoint: checkpoint.Checkpoint | None = None
        self.sinks: Fanout | None = None
        self.uploader: remote.Uploader | None = None
        self.saver: checkpoint.BackgroundSaver | None = None  # rank 0, async_save: writes in the background
        self.shard_saver: ShardSaver | None = None  # FSDP + async_save: this rank's shards, in a thread
        self.shards_staged: Future[Any] | None = None  # FSDP + async_save: this rank's shards being copied
        self.shards_written: Future[Any] | None = None  # FSDP + async_save, ranks but 0: being written

    def attach(self, model: nn.Module, base: nn.Module, optimizer: torch.optim.Optimizer, loader: TrainLoader,
               scaler: torch.amp.GradScaler, sinks: Fanout | None, uploader: remote.Uploader | None) -> None:
        """What a save holds (the wrapped and the single-device model, ...) and where rank 0 records it."""
        self.model, self.base, self.optimizer, self.loader, self.scaler = model, base, optimizer, loader, scaler
        self.sinks, self.uploader = sinks, uploader
        if self.main and self.cfg.checkpoint.async_save:
            self.saver = checkpoint.BackgroundSaver()
        group = dist.checkpoint_group(self.cfg.dist) if self.sharded and self.cfg.checkpoint.async_save else None
        if group is not None:  # every rank copies and writes its shards in a thread, on a group of their own
            self.shard_saver = ShardSaver(group, self.device)

    # --- save -----------------------------------------------------------------------------------------------

    def save(self, state: TrainState, is_best: bool, background: bool = False) -> checkpoint.Checkpoint | None:
        """A checkpoint of this step (collective: every rank calls it); rank 0 gets it back.

        `background` (with checkpoint.async_save): staged to host memory and written by a thread; None comes back
        and `collect_saves` records it once written. Under FSDP every rank writes its own shards of the model and
        optimizer through DCP (in the background: staged to host memory, then written by DCP's thread) and hashes
        them; rank 0 adds the small rest and meta.json once all shards are written. No rank gathers the model. The
        save in flight is waited for first, on every rank.
        """
        cfg = self.cfg
        t0 = time.perf_counter()
        # One save at a time, on every rank: `latest` moves in step order, and the previous save's prune (which
        # removes `*.tmp` leftovers) is over before this save's temporary folder is made.
        self.wait_for_saves()
        rngs = gather_rng(self.penv.world_size)
        saved, shards = None, None
        weights: dict[str, torch.Tensor] | None = None
        if self.sharded:  # every rank writes its shards of the model and optimizer: nothing is gathered
            if self.main:
                checkpoint.begin(self.root, state.step)
            dist.barrier()  # the temporary folder exists before any rank writes into it
            folder = checkpoint.tmp_dir(self.root, state.step)
            if background and self.shard_saver is not None:
                inflight = self.shard_saver.save(self.model, self.optimizer, folder)
                shards, self.shards_staged = inflight.written, inflight.staged
                if not self.main:  # rank 0's writer thread waits for it, then finishes the checkpoint
                    self.shards_written = shards
            else:
                save_shards(self.model, self.optimizer, folder)
        elif self.main:
            weights = model_state(self.base)
        if self.main:
            trainer = {"optimizer": None if self.sharded else self.optimizer.state_dict(),
                       "loader": self.loader.state_dict(), "state": asdict(state), "rng": rngs,
                       "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None}
            meta = {"tokens": state.tokens, "train_loss": state.last_train_loss, "val_loss": state.last_val_loss,
                    "best_val_loss": state.best_val_loss, "config_hash": config_hash(cfg), "phase": self.phase,
                    "tokenizer": self.tokenizer, "world_size": self.penv.world_size,
                    **({"shapes": self.shapes} if self.sharded else {})}  # whole shapes: the shards are parts
            if self.saver is not None and background:  # staged to host memory here, written in the background
                self.saver.save(self.root, state.step, weights, trainer, meta, keep_last=cfg.checkpoint.keep_last,
                                is_best=is_best, waited=time.perf_counter() - t0, shards=shards)
            else:
                self.collect_saves()  # the one that was in flight: recorded before this one
                saved = checkpoint.save(self.root, state.step, weights, trainer, meta,
                                        keep_last=cfg.checkpoint.keep_last, is_best=is_best, prepared=self.sharded)
                seconds = time.perf_counter() - t0
                self.saved(checkpoint.Saved(saved, is_best, seconds, seconds))
        dist.barrier()
        return saved

    def wait_for_staging(self) -> None:
        """Every rank, before the optimizer changes the weights: the save in flight has its host copy (torchtitan:
        CheckpointManager.maybe_wait_for_staging). Rank 0 also waits for its writer's copy of the rest; the wait
        counts as the save's blocked time."""
        t0 = time.perf_counter()
        if self.shards_staged is not None:
            self.shards_staged.result()
            self.shards_staged = None
        if self.saver is not None:
            self.saver.wait_staged(waited=time.perf_counter() - t0)

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
            raise CheckpointError(f"could not write this rank's shards of a checkpoint in {self.root}: "
                                  f"{str(e).splitlines()[0]}") from None
        self.shards_written = None
        return True

    def close(self) -> None:
        """Every rank, at the end of the run: the shard saver's thread ends, joined when no save is in flight (one
        that is still being written after a stop's grace ran out finishes before the process exits)."""
        if self.shard_saver is not None:
            in_flight = self.shards_written is not None or (self.saver is not None and self.saver.in_flight)
            self.shard_saver.close(wait=not in_flight)

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
        runs.update_meta(self.run_dir, step=saved.meta["step"], tokens=saved.meta["tokens"],
                         last_checkpoint=saved.path.name, best_val_loss=saved.meta["best_val_loss"])
        if self.uploader:  # in the background: training goes on while it uploads
            self.uploader.submit(saved, done.is_best)
        # k8s doctor reads the save time back from the pod's log
        self.say(checkpoint_line(saved.meta["step"], done.write_seconds, done.blocked_seconds))
        if self.sinks:
            self.sinks.log({"kind": "checkpoint", "step": saved.meta["step"], "path": str(saved.path),
                            "best": done.is_best, "blocked_seconds": round(done.blocked_seconds, 4),
                            "write_seconds": round(done.write_seconds, 4), "phase": self.phase,
                            "time": time.time()})
        self.last_checkpoint = saved

    # --- resume ---------------------------------------------------------------------------------------------

    def restore_weights(self, base: nn.Module, resume: str, init_weights: Path | None) -> checkpoint.Checkpoint | None:
        """Load the checkpoint to resume from (`resume`: auto, never or a path), or else `init_weights`, into the
        single-device (or already sharded) model; the checkpoint it came from. `resumed` names the one resumed."""
        if resume == "never" and checkpoint.complete_checkpoints(self.root):
            raise UserInputError(
                f"{self.run_dir} already has checkpoints; resume it (--resume auto), or choose another run.name"
            )
        if resume == "auto":  # a local folder without checkpoints resumes from object storage: one process
            # per folder downloads, the others wait on the folder (no collective)
            restore.restore_once(self.cfg, self.phase, self.root, self.say)
            self.resumed = checkpoint.find_resumable(self.root, warn=lambda m: self.say(f"warning: {m}"))
            recorded = runs.read_meta(self.run_dir).get("last_checkpoint")
            if self.resumed is None and recorded:  # the folder was emptied, or is not the one mounted
                raise UserInputError(
                    f"{self.run_dir} recorded checkpoint {recorded} but {self.root} holds none: the run would start "
                    f"again from step 0 and cut its metrics; restore the checkpoints, or start afresh on purpose "
                    f"with --resume never"
                )
        elif resume != "never":
            if not Path(resume).exists():
                raise UserInputError(f"--resume: no such checkpoint or run directory: {resume}")
            self.resumed = checkpoint.resolve(Path(resume))
        source = self.resumed or (checkpoint.resolve(init_weights) if init_weights is not None else None)
        if source is not None:
            checkpoint.check_compatible(source, self.shapes, self.tokenizer)
            if parallelize.is_sharded(base) and source.sharded:  # DCP reads this rank's part, resharded
                load_model_shards(base, source.path)
            elif parallelize.is_sharded(base):  # each rank reads only the bytes of its shards
                parallelize.load_safetensors(base, [source.path / checkpoint.MODEL_FILE])
            else:  # whole weights; an FSDP checkpoint's shards are assembled by each process (DCP, no collective)
                load_model_state(base, source.model_state())
        return source

    def restore_trainer(self, ckpt: checkpoint.Checkpoint, model: nn.Module, optimizer: torch.optim.Optimizer,
                        loader: TrainLoader, scaler: torch.amp.GradScaler) -> TrainState:
        """Optimizer, data cursor and RNG streams of the checkpoint we resume (loaded into them); its counters."""
        trainer = ckpt.trainer_state()
        load_optimizer(model, optimizer, ckpt, trainer, self.sharded)
        try:
            loader.load_state_dict(trainer["loader"])
        except ValueError as e:
            raise IncompatibleCheckpointError(f"cannot resume {ckpt.path}: {e}") from None
        state = TrainState(**trainer["state"])
        if "best_saved_val_loss" not in trainer["state"]:  # saved when every improvement was saved, as `best`
            state.best_saved_val_loss = state.best_val_loss
        if scaler.is_enabled() and trainer.get("scaler"):
            scaler.load_state_dict(trainer["scaler"])
        rngs = trainer["rng"]
        if len(rngs) == self.penv.world_size:
            set_rng_state(rngs[self.penv.rank])
        else:
            self.say(f"note: the checkpoint has RNG states of {len(rngs)} ranks, this run has {self.penv.world_size}")
        self.say(f"resuming from {ckpt.path} (step {state.step}, {state.tokens:,} tokens)")
        return state

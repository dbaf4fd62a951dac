"""Write checkpoints that never lose work: into a temporary folder, checksummed, fsynced, renamed.

The model weights and the optimizer tensors go out through our safetensors writer (tensorfile); meta.json
lists the xxh3-128 digest and size of every file, which is what `read.verify` checks before anything loads.
`BackgroundSaver` does the same `save` in a thread, from host copies staged at the step boundary.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from kubetrain.checkpoint import diverged, tensorfile
from kubetrain.checkpoint.layout import (
    BEST,
    CHECKSUM,
    LATEST,
    META_FILE,
    MODEL_FILE,
    TRAINER_FILE,
    TRAINER_TENSORS,
    complete_checkpoints,
    file_digest,
    pointer,
    step_name,
    tmp_dir,
)
from kubetrain.checkpoint.read import Checkpoint
from kubetrain.checkpoint.sharded import collect_digests
from kubetrain.errors import CheckpointError
from kubetrain.files import fsync_dir, fsync_file, write_atomic


def unique_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies, each storage once (tied weights are saved under their first name)."""
    seen: set[tuple[int, int]] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), int(t.storage_offset()))
        if t.numel() and key in seen:
            continue
        seen.add(key)
        out[name] = t.detach().to("cpu").contiguous()
    return out


def save(
    root: Path,
    step: int,
    model_state: dict[str, torch.Tensor] | None,
    trainer_state: dict[str, Any],
    meta: dict[str, Any],
    *,
    keep_last: int,
    is_best: bool = False,
    prepared: bool = False,
) -> Checkpoint:
    """Write one checkpoint atomically, move `latest` (and `best`) to it, prune old ones.

    A failure at any point (full disk, no permission, a kill) leaves the previous checkpoint and the
    `latest` pointer as they were. `prepared`: the caller made the temporary folder with `begin` and
    the ranks wrote their shards into it (FSDP); the digests each rank took of its own files go into meta.json
    as they are, the rest is hashed here. `model_state` None: the weights are in those shards (then
    meta["shapes"] names their whole shapes).
    """
    name = step_name(step)
    final = root / name
    tmp = tmp_dir(root, step)
    previous = pointer(root, LATEST)
    try:
        if not prepared:
            begin(root, step)
        written = collect_digests(tmp)  # the shards' digests, taken by the ranks that wrote them
        shapes = meta.get("shapes", {})
        if model_state is not None:
            tensors = unique_tensors(model_state)
            written[MODEL_FILE] = tensorfile.write(tmp / MODEL_FILE, tensors)
            shapes = {k: list(v.shape) for k, v in tensors.items()}
        # The big optimizer tensors go to a safetensors file at disk speed; trainer.pt keeps the small rest.
        trainer_tensors: dict[str, torch.Tensor] = {}
        skeleton = tensorfile.split(trainer_state, trainer_tensors)
        written[TRAINER_TENSORS] = tensorfile.write(tmp / TRAINER_TENSORS, trainer_tensors)
        torch.save(skeleton, tmp / TRAINER_FILE)
        files = sorted(f for f in tmp.rglob("*") if f.is_file() and f.name != META_FILE)
        others = [f for f in files if str(f.relative_to(tmp)) not in written]
        # The rest (trainer.pt, the shards' .metadata) is hashed and fsynced at once: both release the GIL.
        with ThreadPoolExecutor(max_workers=4) as pool:
            written.update(zip((str(f.relative_to(tmp)) for f in others), pool.map(_digest_and_sync, others),
                               strict=True))
        digests = [written[str(f.relative_to(tmp))] for f in files]
        full_meta = {
            **meta,
            "step": step,
            "files": {
                str(f.relative_to(tmp)): {CHECKSUM: d, "bytes": f.stat().st_size}
                for f, d in zip(files, digests, strict=True)
            },
            "shapes": shapes,
        }
        write_atomic(tmp / META_FILE, json.dumps(full_meta, indent=2))
        fsync_dir(tmp)
        if final.exists():  # an earlier save of the same step (a resumed run re-saving): replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(root)
        diverged.forget(root, name)
        write_atomic(root / LATEST, name + "\n")
        if is_best:
            write_atomic(root / BEST, name + "\n")
        fsync_dir(root)
    except (OSError, RuntimeError, SafetensorError) as e:
        # torch.save reports a full disk as RuntimeError and safetensors as SafetensorError.
        why = os.strerror(e.errno) if isinstance(e, OSError) and e.errno else str(e).splitlines()[0]
        raise _not_saved(root, step, why, previous) from None
    prune(root, keep_last)
    return Checkpoint(final, full_meta)


def _not_saved(root: Path, step: int, why: str, previous: str | None) -> CheckpointError:
    """The error of a failed save, after its temporary folder is gone."""
    shutil.rmtree(tmp_dir(root, step), ignore_errors=True)
    kept = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint was written"
    return CheckpointError(f"could not save checkpoint {step_name(step)} in {root}: {why}; {kept}")


def wait_for_shards(written: Future[Any], root: Path, step: int) -> None:
    """Wait until every rank wrote its part of this checkpoint (its shards); a failed part fails it."""
    try:
        written.result()
    except BaseException as e:  # DCP's CheckpointException is a BaseException; it names the ranks that failed
        raise _not_saved(root, step, f"a rank could not write its shards ({str(e).splitlines()[0]})",
                         pointer(root, LATEST)) from None


def begin(root: Path, step: int) -> Path:
    """A fresh temporary folder for the checkpoint of `step` (what a killed save left there is discarded)."""
    tmp = tmp_dir(root, step)
    root.mkdir(parents=True, exist_ok=True)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def _digest_and_sync(path: Path) -> str:
    digest = file_digest(path)
    fsync_file(path)
    return digest


def prune(root: Path, keep_last: int) -> None:
    """Keep the newest `keep_last` checkpoints, plus the ones `latest` and `best` name."""
    keep = {pointer(root, LATEST), pointer(root, BEST)}
    ckpts = complete_checkpoints(root)
    for p in ckpts[: max(0, len(ckpts) - keep_last)]:
        if p.name not in keep:
            shutil.rmtree(p, ignore_errors=True)
    for p in root.glob("*.tmp"):  # leftovers of a save that was killed
        shutil.rmtree(p, ignore_errors=True)


def stage(obj: Any) -> Any:
    """A host copy of a (nested) state that training can no longer change: tensors copied, containers rebuilt.

    Tied weights stay tied (one copy per storage), so `unique_tensors` still saves them once.
    """
    copies: dict[tuple[Any, ...], torch.Tensor] = {}

    def copy(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            key = (value.untyped_storage().data_ptr(), int(value.storage_offset()), value.shape, value.dtype)
            if key not in copies or not value.numel():
                t = value.detach()
                copies[key] = t.clone() if t.device.type == "cpu" else t.to("cpu")
            return copies[key]
        if isinstance(value, dict):
            return {k: copy(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(copy(v) for v in value)
        return value

    return copy(obj)


@dataclass
class Saved:
    """A finished background save: the checkpoint, and how long it took."""

    checkpoint: Checkpoint
    is_best: bool
    blocked_seconds: float  # the loop waited this long (gathering, the previous save, the rest of the copy)
    write_seconds: float  # staging to the last fsync: the whole save


class BackgroundSaver:
    """One checkpoint save in flight at a time, copied to host memory and written by `save` in a thread.

    The copy overlaps the next step: a step's data loading, forward and backward read the weights and the
    optimizer state but do not change them; only the optimizer step does, so the loop calls `wait_staged()`
    just before it, and training stops only for whatever of the copy is left by then. Every guarantee of
    `save` holds (temporary folder, checksums, fsync, rename, `latest` moved last): the thread runs that same
    function on the copies. The thread is not a daemon, so a process that ends normally finishes the save;
    a SIGKILL at any point leaves the previous checkpoint and `latest` as they were. Under FSDP the ranks write
    their shards of the model and optimizer into the same temporary folder through DCP's own thread (`shards`)
    and hash them there: this one waits for all of them, then writes the small rest, meta.json, and renames.
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._staged: threading.Event | None = None
        self._done: list[Saved] = []
        self._error: BaseException | None = None
        self._waited_for_copy: dict[int, float] = {}  # step -> seconds the loop waited in wait_staged
        self._step = -1  # the step of the save in flight
        self._lock = threading.Lock()

    def save(self, root: Path, step: int, model_state: dict[str, torch.Tensor] | None, trainer_state: dict[str, Any],
             meta: dict[str, Any], *, keep_last: int, is_best: bool = False, waited: float = 0.0,
             shards: Future[Any] | None = None) -> float:
        """Wait for the save in flight, then copy and write this one in a thread; the seconds blocked so far.

        `waited`: seconds the caller already spent for this save (gathering state), counted as blocked. The
        caller must not change the state before `wait_staged()` returns. `shards`: the ranks are writing their
        shards of the model and optimizer into the temporary folder (FSDP, `model_state` None); the checkpoint is
        finished once they all have.
        """
        t0 = time.perf_counter()
        self.wait()
        blocked = waited + time.perf_counter() - t0
        staged = self._staged = threading.Event()

        def write() -> None:
            try:
                try:
                    staged_model, staged_trainer = stage(model_state), stage(trainer_state)
                finally:
                    staged.set()
                if shards is not None:
                    wait_for_shards(shards, root, step)
                saved = save(root, step, staged_model, staged_trainer, meta, keep_last=keep_last, is_best=is_best,
                             prepared=shards is not None)
            except BaseException as e:  # handed to the loop's thread, which raises it at its next step
                with self._lock:
                    self._error = e
                return
            with self._lock:
                self._done.append(Saved(saved, is_best, blocked, waited + time.perf_counter() - t0))

        self._thread = threading.Thread(target=write, name=f"kubetrain-save-{step}", daemon=False)
        self._thread.start()
        self._step = step
        return blocked

    def wait_staged(self, waited: float = 0.0) -> None:
        """Before the optimizer changes the weights: wait until the save in flight has its copy. `waited`: seconds
        the caller already waited for this save's other copies (the shards), counted with this wait as blocked."""
        if self._staged is None:
            return
        t0 = time.perf_counter()
        self._staged.wait()
        self._staged = None
        with self._lock:
            self._waited_for_copy[self._step] = waited + time.perf_counter() - t0

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the save in flight (at most `timeout` seconds); True when none is left."""
        if self._thread is not None:
            self._thread.join(timeout)
        if not self.in_flight:
            self._staged = None
        return not self.in_flight

    def collect(self) -> list[Saved]:
        """The saves finished since the last call; the error of a failed one is raised here, in the caller.

        Each one's blocked time includes the wait for its copy before the next optimizer step."""
        with self._lock:
            done, self._done = self._done, []
            error, self._error = self._error, None
            for d in done:
                d.blocked_seconds += self._waited_for_copy.pop(d.checkpoint.step, 0.0)
        if error is not None:
            raise error
        return done

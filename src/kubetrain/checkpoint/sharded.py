"""FSDP2 state through torch.distributed.checkpoint (DCP), torchtitan's way: every rank writes its own shards of the
model and the optimizer into `shards/`, hashes the files it wrote, and no process ever holds the whole model to
save it. DCP reshards on load, so the world size may change (also to one process, or DDP).

The portable whole-model file is made from the shards only when asked (`consolidated_model`: export, generate,
a DDP or single-process run starting from them). Checkpoints of earlier versions (model.safetensors, the
optimizer alone in `optimizer/`) still load (`load_optimizer`).
"""

from __future__ import annotations

import json
import shutil
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as td
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor

from kubetrain.checkpoint.layout import OPTIMIZER_DIR, SHARDS_DIR, file_digest
from kubetrain.errors import IncompatibleCheckpointError
from kubetrain.files import fsync_dir, write_atomic

DIGESTS_DIR = ".digests"  # beside shards/ while a save is in flight: each rank's digests of the files it wrote
_DCP_SUFFIX = ".distcp"  # FileSystemWriter's file names: __<rank>_<n>.distcp, then .metadata from rank 0


class HashingWriter(FileSystemWriter):
    """DCP's file writer, and each rank hashes (xxh3-128) the files it just wrote, while it still has them in the
    page cache, into `<checkpoint>/.digests/<prefix>json`: rank 0 reads those small files to write meta.json, so no
    digest, and no tensor, travels through a collective or is hashed twice. The digest file is written before this
    rank reports its write to DCP's coordinator, so it exists by the time `.metadata` does."""

    def write_data(self, plan: Any, planner: Any) -> torch.futures.Future[list[WriteResult]]:
        written = super().write_data(plan, planner)
        written.wait()  # FileSystemWriter writes synchronously: the future is already done
        prefix = plan.storage_data.prefix  # "__<rank in the checkpoint's group>_", FileSystemWriter's own naming
        folder = Path(self.path)
        # every file this rank made, also one with nothing in it (a rank whose plan is empty still writes a file)
        mine = sorted(f for f in folder.iterdir() if f.name.startswith(prefix) and f.name.endswith(_DCP_SUFFIX))
        digests = {f"{folder.name}/{f.name}": file_digest(f) for f in mine}
        digest_dir = folder.parent / DIGESTS_DIR
        digest_dir.mkdir(exist_ok=True)
        write_atomic(digest_dir / f"{prefix}json", json.dumps(digests))
        return written


def collect_digests(checkpoint_dir: Path) -> dict[str, str]:
    """Rank 0, once every rank wrote: the digests the ranks recorded, by file; the digest files are removed."""
    digest_dir = checkpoint_dir / DIGESTS_DIR
    if not digest_dir.is_dir():
        return {}
    found: dict[str, str] = {}
    for f in sorted(digest_dir.iterdir()):
        found.update(json.loads(f.read_text()))
    shutil.rmtree(digest_dir)
    fsync_dir(checkpoint_dir)
    return found


# --- what is saved ------------------------------------------------------------------------------------------------


def checkpointed_names(model: nn.Module) -> set[str] | None:
    """The weights a checkpoint keeps: the trainable ones when some are frozen (LoRA), else None (all of them)."""
    params = dict(model.named_parameters())
    trainable = {n for n, p in params.items() if p.requires_grad}
    return None if len(trainable) == len(params) else trainable


def model_shards(model: nn.Module) -> dict[str, Any]:
    """This rank's part of every checkpointed weight (sharded DTensors under FSDP, not copies; whole tensors
    otherwise). Never a full state dict: nothing is gathered."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(model)
    keep = checkpointed_names(model)
    return {k: v for k, v in state.items() if keep is None or k in keep}


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return {"model": model_shards(model), "optimizer": get_optimizer_state_dict(model, optimizer)}


def save_shards(model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint_dir: Path) -> None:
    """Collective: each rank writes (and hashes) its shards of the model and optimizer into checkpoint_dir/shards."""
    import torch.distributed.checkpoint as dcp

    dcp.save(sharded_state(model, optimizer), storage_writer=HashingWriter(checkpoint_dir / SHARDS_DIR))


@dataclass
class ShardsInFlight:
    """A background save of this rank's shards: `staged` once the copy to host memory is made (the optimizer may
    change the weights from then on), `written` once every rank wrote and rank 0 wrote `.metadata`."""

    staged: Future[None]
    written: Future[None]


def pinned_staging(device_type: str) -> bool:
    """Whether background saves stage into pinned host buffers made once and reused by every later save.

    On CUDA, yes: DCP's BlockingAsyncStager with `cache_staged_state_dict=True` (public, torch 2.4 to 2.13): the
    first save allocates a pinned CPU copy of the rank's state, every save copies into it, so a save costs one
    device-to-host copy at pinned speed and no allocation. That is torchtitan's `async_with_pinned_mem`
    (CheckpointManager: a pinned CPU state dict made once, copied into at each save while the next step runs,
    `maybe_wait_for_staging` before the optimizer step). Not DCP's DefaultStager, which torchtitan now passes
    (`DefaultStager(StagingOptions(True, True, True, True))`): from torch 2.11 it drops its cached storages after
    every stage (staging.py, DefaultStager._stage: `self._state_dict_stager.close()`), so each save would pin fresh
    memory; and torch 2.8 has none. A GPU process's host memory holds its shards' copy for the run, as torchtitan's.

    On the CPU, no: the training state is already in host memory, and a copy kept for the run would be one more
    resident copy of each rank's shards (measured: the 85M GPT's largest FSDP process 1,172 -> 1,410 MiB at 4
    ranks, past the 0.40x of DDP's that FSDP's memory is held to). Fresh buffers per save (`host_buffers`), freed
    once written; touching their pages is the copy's cost, and the saver's thread pays it while the next step runs.
    """
    return device_type == "cuda"


def host_buffers(state: Any) -> Any:
    """Empty CPU tensors shaped as `state`'s CPU tensors (a DTensor stays a DTensor over the same mesh and
    placements), the rest as it is. Nothing is copied and no page is touched: cheap enough for the training loop,
    which is where a save allocates them so that the memory comes from the loop's own allocator arena (allocated in
    the saver's thread it came from another glibc arena, and the 85M GPT's largest FSDP process peaked at
    1,293-1,330 MiB at 4 ranks instead of 1,186-1,223). Not torch's `_create_cpu_state_dict`: it deep-copies every
    CPU DTensor (a full copy, in the loop) before swapping its local tensor."""
    if isinstance(state, DTensor):
        return DTensor.from_local(torch.empty_like(state.to_local()), state.device_mesh, state.placements,
                                  run_check=False, shape=state.shape, stride=state.stride())
    if isinstance(state, torch.Tensor):
        return torch.empty_like(state)
    if isinstance(state, dict):
        return {k: host_buffers(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(host_buffers(v) for v in state)
    return state


def copy_state(state: Any, into: Any) -> Any:
    """`state` copied into `into` (made by `host_buffers`): every tensor's data, and a new container of the rest's
    values as they are now."""
    if isinstance(state, DTensor):
        into.to_local().copy_(state.to_local())
        return into
    if isinstance(state, torch.Tensor):
        return into.copy_(state)
    if isinstance(state, dict):
        return {k: copy_state(v, into[k]) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(copy_state(v, w) for v, w in zip(state, into, strict=True))
    return state


class ShardSaver:
    """This rank's background saves of its shards, one at a time, in one thread of its own.

    The thread copies the shards to host memory (the next step's forward and backward run meanwhile: they read the
    weights and optimizer state but do not change them; the loop waits for `staged` before the optimizer step),
    then writes and hashes them with `dcp.save` on `group` (a process group of its own, see
    distributed.setup.checkpoint_group), as DCP's own `async_save` does in its thread executor
    (`_ThreadBasedAsyncCheckpointExecutor`: `save` on the staged state, the given group). DCP's `async_save` copies
    before it returns, in the loop; copying in the thread is what keeps a save's copy off the loop (torchtitan's
    `async_with_pinned_mem` overlaps it the same way).

    DCP's last step (state_dict_saver._save_state_dict: `distW.all_reduce("write", write_data, finish_checkpoint)`)
    gathers every rank's write results on rank 0, which then writes `.metadata`, and broadcasts the outcome: the
    `written` future completes on every rank only after all of them wrote, and a rank's failure fails them all.
    The thread is not a daemon: a process that ends normally finishes its save first.
    """

    def __init__(self, group: td.ProcessGroup, device: torch.device) -> None:
        from torch.distributed.checkpoint.staging import BlockingAsyncStager

        self.group, self.device = group, device
        # CUDA: one stager for the run, whose pinned buffers every save reuses; CPU: fresh buffers per save
        self.stager = BlockingAsyncStager(cache_staged_state_dict=True) if pinned_staging(device.type) else None
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="kubetrain-shards", initializer=self._on_device)

    def _on_device(self) -> None:
        if self.device.type == "cuda":  # a new thread starts on device 0: copy from this rank's GPU
            torch.cuda.set_device(self.device)

    def save(self, model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint_dir: Path) -> ShardsInFlight:
        """Collective (in the thread, on `group`): this rank's shards of the model and optimizer into
        checkpoint_dir/shards, hashed. The caller must not step the optimizer before `staged` completes, nor start
        another save before `written` does."""
        import torch.distributed.checkpoint as dcp

        state = sharded_state(model, optimizer)  # this rank's DTensors: views of the live weights, not copies
        buffers = None if self.stager is not None else host_buffers(state)
        staged: Future[None] = Future()

        def stage_and_write() -> None:
            try:
                with torch.no_grad():
                    host = self.stager.stage(state) if self.stager is not None else copy_state(state, buffers)
            except BaseException as e:
                staged.set_exception(e)
                raise
            staged.set_result(None)
            dcp.save(host, storage_writer=HashingWriter(checkpoint_dir / SHARDS_DIR), process_group=self.group)

        return ShardsInFlight(staged, self.thread.submit(stage_and_write))

    def close(self, wait: bool) -> None:
        """The end of the run: the thread ends (`wait`: joined here; else once the save it is writing is written)."""
        self.thread.shutdown(wait=wait)


# --- loading --------------------------------------------------------------------------------------------------------


def _read(state: dict[str, Any], checkpoint_dir: Path, folder: str, no_dist: bool = False) -> None:
    """DCP load of `state` from checkpoint_dir/folder, after its files proved to be what meta.json lists, and with
    nothing in them able to run code (safe_dcp)."""
    import torch.distributed.checkpoint as dcp

    from kubetrain.checkpoint.safe_dcp import SafeFileSystemReader, SafeLoadPlanner, load_metadata, verify_files

    verify_files(checkpoint_dir, folder)
    load_metadata(checkpoint_dir / folder / ".metadata")  # refused here, with our message, before DCP starts
    with warnings.catch_warnings():  # one process without a process group is what we mean, not a mistake
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, storage_reader=SafeFileSystemReader(checkpoint_dir / folder), planner=SafeLoadPlanner(),
                 no_dist=no_dist)


def has_shards(checkpoint_dir: Path) -> bool:
    return (checkpoint_dir / SHARDS_DIR).is_dir()


def load_model_shards(model: nn.Module, checkpoint_dir: Path) -> None:
    """Collective: this rank's part of every weight, read from the shards (resharded to this world)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    state = {"model": model_shards(model)}
    _read(state, checkpoint_dir, SHARDS_DIR)
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))


def load_optimizer_shards(model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint_dir: Path) -> None:
    """Collective: the optimizer state read from the shards, resharded to this world (FSDP, DDP or one process)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    # get_optimizer_state_dict initialises empty AdamW state (a zero-lr step), giving DCP tensors to load into.
    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    _read(state, checkpoint_dir, SHARDS_DIR)
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def load_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint_dir: Path) -> None:
    """Collective: the optimizer of an earlier FSDP checkpoint (optimizer/ beside model.safetensors)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    _read(state, checkpoint_dir, OPTIMIZER_DIR)
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def load_whole_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Collective: the optimizer of a whole-model checkpoint (one process or DDP: torch's `Optimizer.state_dict`,
    keyed by parameter index) into a sharded model's optimizer, each rank keeping its part.

    The indices become names in the order both optimizers list their parameters (`build_optimizer` lists them the
    same way whatever wraps the model), as DCP's `get_optimizer_state_dict` names them; DCP's
    `set_optimizer_state_dict` with `full_state_dict` then cuts each whole tensor into this rank's shard. Every rank
    holds the whole optimizer state while it loads, once, at the resume (each rank reads the checkpoint itself)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    named: dict[str, Any] = get_optimizer_state_dict(model, optimizer)
    names = [n for group in named["param_groups"] for n in group["params"]]
    indices = [i for group in saved["param_groups"] for i in group["params"]]
    if len(names) != len(indices):
        raise IncompatibleCheckpointError(f"the checkpoint's optimizer has {len(indices)} parameters, this model "
                                          f"{len(names)}")
    name_of = dict(zip(indices, names, strict=True))
    whole: dict[str, Any] = {
        "state": {name_of[i]: state for i, state in saved["state"].items()},
        "param_groups": [{**group, "params": [name_of[i] for i in group["params"]]} for group in saved["param_groups"]],
    }
    set_optimizer_state_dict(model, optimizer, whole, options=StateDictOptions(full_state_dict=True))


def consolidated_model(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    """Every checkpointed weight whole, read from the shards by this process alone (export, generate, a run that
    starts from them without FSDP): the one place a whole model is assembled, and only when asked.

    What DCP's format_utils.dcp_to_torch_save does (an empty state dict planned from `.metadata`), but only for
    the model's keys (the optimizer's are not read), through safe_dcp, and into tensors, not a pickle."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from kubetrain.checkpoint.safe_dcp import load_metadata

    metadata = load_metadata(checkpoint_dir / SHARDS_DIR / ".metadata")
    weights = {key.removeprefix("model."): torch.empty(md.size, dtype=md.properties.dtype)
               for key, md in metadata.state_dict_metadata.items()
               if key.startswith("model.") and isinstance(md, TensorStorageMetadata)}
    state = {"model": weights}
    _read(state, checkpoint_dir, SHARDS_DIR, no_dist=True)
    return state["model"]

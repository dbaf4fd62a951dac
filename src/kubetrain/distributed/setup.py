"""Start and stop the process group (data parallelism is applied in distributed.parallelize)."""

from __future__ import annotations

import contextlib
import datetime

import torch
import torch.distributed as td

from kubetrain.config.clocks import collective_timeouts
from kubetrain.config.schema import DistConfig
from kubetrain.distributed.env import ProcessEnv, process_env
from kubetrain.torch_compat import release_destroyed_groups, set_default_group_timeout


def init(cfg: DistConfig, device: torch.device) -> ProcessEnv:
    """Join the process group when launched as one of several workers; a no-op for one process.

    The group starts with the generous start-up timeout (`init_timeout_seconds`): until the first step, ranks
    reach their first collectives at different times (loading, restoring, compiling). `use_step_timeout`
    lowers it once the first step is done, as torchtitan does.
    """
    penv = process_env()
    if not penv.distributed or td.is_initialized():
        return penv
    backend = cfg.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    td.init_process_group(
        backend=backend,
        timeout=datetime.timedelta(seconds=collective_timeouts(cfg)[0]),
        device_id=device if device.type == "cuda" else None,
    )
    return penv


def use_step_timeout(cfg: DistConfig, device: torch.device) -> None:
    """Every collective from now on fails after the step timeout (config/clocks.py: after the hang watch acts).

    A barrier first, under the start-up timeout: a slow rank may still be in start-up work while a fast one
    would otherwise start its next collective with the short timeout and fail (torchtitan's set_pg_timeouts).
    """
    if not td.is_initialized():
        return
    td.barrier(device_ids=[device.index] if device.type == "cuda" and device.index is not None else None)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    set_default_group_timeout(datetime.timedelta(seconds=collective_timeouts(cfg)[1]))


_checkpoint_group: td.ProcessGroup | None = None  # made once per process group (phases share it), gone at teardown


def checkpoint_group(cfg: DistConfig) -> td.ProcessGroup | None:
    """A gloo group of every rank for the collectives of background checkpoint writes (collective: all ranks call it).

    A background save's `dcp.save` plans and gathers its write results in the saver's thread; on a group of their
    own those collectives never interleave with the training loop's on the main group (torchtitan and PyTorch's async
    checkpoint recipe do the same). gloo: DCP needs a CPU backend for it. The timeout stays the generous start-up
    one: the final gather waits for the slowest rank's write, which may take longer than a step.
    """
    global _checkpoint_group
    if not td.is_initialized():
        return None
    if _checkpoint_group is None:
        seconds = collective_timeouts(cfg)[0]
        _checkpoint_group = td.new_group(backend="gloo", timeout=datetime.timedelta(seconds=seconds))
    return _checkpoint_group


# Ranks that ended cleanly reach teardown within seconds of each other; rank 0 may still be uploading checkpoints,
# and a peer that leaves after this wait is harmless then (no collective is in flight).
TEARDOWN_BARRIER_SECONDS = 30.0


def teardown(healthy: bool = True, barrier_seconds: float = TEARDOWN_BARRIER_SECONDS) -> None:
    """Leave the process group; after a clean end (finished, stopped together, dry run) meet the peers first.

    gloo aborted a peer ('terminate called without an active exception') when a rank closed its connections while
    the peer still talked to it, so a healthy group passes a barrier before it is destroyed. The barrier waits at
    most `barrier_seconds`, and a peer that is gone only skips it. After an error (`healthy` False) a peer may be
    inside a collective that a barrier would cut across, or never arrive: the group is left at once.

    After a clean end the backends then go here, not during interpreter exit: destroy_process_group leaves a gloo
    backend and its threads alive while anything still holds its group, and after FSDP its reference cycles and
    (torch 2.11 on) the meshes DTensor's caches keep do (torch_compat.release_destroyed_groups). Not after an
    error: a backend's destructor waits for the collective its thread is in, which a lost peer may hold until the
    group's timeout.
    """
    global _checkpoint_group
    if not td.is_initialized():
        return
    _checkpoint_group = None  # destroyed with the rest below
    if healthy and td.get_world_size() > 1:
        with contextlib.suppress(RuntimeError):  # timed out, or a peer closed its connection: leave anyway
            bounded_barrier(datetime.timedelta(seconds=barrier_seconds))
    td.destroy_process_group()
    if healthy:
        release_destroyed_groups()


def bounded_barrier(timeout: datetime.timedelta) -> None:
    """A barrier that raises after `timeout` instead of waiting for the group's (long start-up) timeout.

    gloo: monitored_barrier, whose send/recv are waited for in this thread with this timeout (td.barrier's work
    would stay queued in gloo's worker thread until the group's own timeout). NCCL: an async barrier whose wait
    blocks this thread at most `timeout` (Work.wait's documented behaviour with a timeout).
    """
    if td.get_backend() == td.Backend.GLOO:
        td.monitored_barrier(timeout=timeout)
        return
    work = td.barrier(async_op=True)
    if work is not None:
        work.wait(timeout)


def barrier() -> None:
    if td.is_initialized():
        td.barrier()


def start_all_reduce_sum(value: torch.Tensor) -> td.Work | None:
    """Start summing `value` over ranks in place (its device's backend runs it while the host goes on); None alone.

    Wait on the returned work before reading `value`; on NCCL that wait only orders the GPU stream (no host sync).
    """
    if not td.is_initialized() or td.get_world_size() == 1:
        return None
    return td.all_reduce(value, op=td.ReduceOp.SUM, async_op=True)


def all_reduce(value: torch.Tensor, op: td.ReduceOp.RedOpType = td.ReduceOp.SUM) -> torch.Tensor:
    """`value` reduced over ranks by `op` (sum, max, min), in a new tensor (a copy of it for one process)."""
    value = value.clone()
    if td.is_initialized() and td.get_world_size() > 1:
        td.all_reduce(value, op=op)
    return value


def local_part(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `t`: its shard under FSDP2 (a DTensor), else `t` itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t

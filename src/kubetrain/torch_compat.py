"""Every difference between the torch versions kubetrain supports (2.8 to 2.13), decided in one place.

Each difference is settled by feature detection where torch offers something to detect, by the version
otherwise, and says what happens on each side. A private torch internal is used only here, behind such a check,
with a fallback that keeps the promise or (where none can) the weaker promise named in docs/torch-versions.md.
Nothing else in kubetrain imports a name with a leading underscore from torch.

Why 2.8 is the oldest: FSDP2's public API (`torch.distributed.fsdp.fully_shard`) exists from 2.6, DCP's
`async_save` on a group of its own and the flight recorder's TORCH_FR_* names from 2.8, and 2.8 is the oldest
torch the NGC images and CUDA 12.8 (Blackwell) wheels still ship. 2.6 and 2.7 would add no user we know of and
two more sets of internals to track.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib
import inspect
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

import torch
from torch import nn

OLDEST_SUPPORTED = (2, 8)


def torch_version(text: str | None = None) -> tuple[int, int]:
    """(major, minor) of `text` (a torch version string), or of the torch this process imports."""
    major, minor = (text or torch.__version__).split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def unsupported_torch(text: str | None = None) -> str | None:
    """Why this torch cannot run kubetrain (one line), or None where it can."""
    found = torch_version(text)
    if found < OLDEST_SUPPORTED:
        oldest = ".".join(map(str, OLDEST_SUPPORTED))
        return (f"kubetrain needs torch >= {oldest} (FSDP2, DCP async saves); this environment has torch "
                f"{text or torch.__version__}: install a newer torch (pip install 'torch>={oldest},<3')")
    return None


# --- torchrun and its agent -----------------------------------------------------------------------------------


def agent_takes_shutdown_timeout() -> bool:
    """Whether torchrun has `--shutdown-timeout` (its LaunchConfig a `shutdown_timeout` field): torch 2.13 on.

    Before it, torchrun refuses the flag ("unrecognized arguments") and its agent gives workers a fixed 30 s
    between SIGTERM and SIGKILL; `elastic_agent` below then passes our timeout itself.
    """
    from torch.distributed.launcher.api import LaunchConfig

    return "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)}


def torchrun_shutdown_args(seconds: int) -> list[str]:
    """The torchrun arguments that give workers `seconds` to save after SIGTERM (none where it has no flag)."""
    return [f"--shutdown-timeout={seconds}"] if agent_takes_shutdown_timeout() else []


@contextlib.contextmanager
def elastic_agent(final_exit_codes: Collection[int], shutdown_timeout: int,
                  on_failure: Callable[[Mapping[int, Any]], None] | None = None) -> Iterator[None]:
    """While torch.distributed.run runs in this process, its agent (a) ends the group instead of restarting it
    after a worker's exit in `final_exit_codes`, (b) waits `shutdown_timeout` seconds for workers after SIGTERM,
    and (c) hands every failed round's failures (ProcessFailure by global rank) to `on_failure` before it acts.

    torch has no option for (a) and, before 2.13, none for (b). `launch_agent` builds a LocalElasticAgent by its
    module name, so the class is swapped for a subclass for this call only:
    - (a) sets the agent's `_remaining_restarts` to 0 (what torch's agent does itself for a worker stuck in the D
      state), so `_invoke_run` stops the workers and reports the failure. Where the attribute is missing (a torch
      built differently), a final exit is restarted like any failure: the group ends after --max-restarts.
    - (b) on torch < 2.13 the agent's shutdown calls `PContext.close(death_sig)` with close's default of 30 s; the
      subclass has that close use our timeout. Where PContext.close takes no timeout, torch's 30 s remain.
    - (c) torch has no hook for it: the watch (launch/watch.py) would otherwise find a worker the agent reaped first
      with no status.
    Where `launcher.api` builds no LocalElasticAgent by that name, nothing is swapped (the fallbacks apply; for (c)
    the watch records such an exit with its status unknown).
    """
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.launcher import api

    set_close_timeout = not agent_takes_shutdown_timeout()

    class KubetrainAgent(LocalElasticAgent):
        def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
            result = super()._monitor_workers(worker_group)
            if result.state == WorkerState.FAILED and on_failure is not None:
                on_failure(result.failures)  # the agent reaped them: only it knows how they ended
            if (result.state == WorkerState.FAILED and hasattr(self, "_remaining_restarts")
                    and any(f.exitcode in final_exit_codes for f in result.failures.values())):
                self._remaining_restarts = 0
            return result

        def _shutdown(self, *args: Any, **kwargs: Any) -> None:
            pcontext = getattr(self, "_pcontext", None)
            if set_close_timeout and pcontext is not None and _takes(pcontext.close, "timeout"):
                close = pcontext.close
                pcontext.close = lambda death_sig=None, timeout=None: close(death_sig, timeout=shutdown_timeout)
            super()._shutdown(*args, **kwargs)

    if getattr(api, "LocalElasticAgent", None) is not LocalElasticAgent:
        yield
        return
    api.LocalElasticAgent = KubetrainAgent  # type: ignore[misc]
    try:
        yield
    finally:
        api.LocalElasticAgent = LocalElasticAgent  # type: ignore[misc]


def _optional(module: str, name: str) -> Any:
    """`module.name`, or None where this torch has no such module or name."""
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


def _takes(function: Callable[..., Any], parameter: str) -> bool:
    try:
        return parameter in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False


# NCCL's flight recorder, by the name each torch reads (c10d's getCvar* lists: the first name is read first, and a
# later one that is set only warns "Environment variable X is deprecated; use Y instead"). torch 2.13 warns for
# TORCH_NCCL_TRACE_BUFFER_SIZE even under gloo (checked: tests/launch/test_elastic.py); TORCH_FR_BUFFER_SIZE and
# TORCH_FR_DUMP_TEMP_FILE are read from 2.8 (NVIDIA/nvidia-resiliency-ext#163 gates on it), TORCH_FR_DUMP_ON_TIMEOUT
# from 2.15 (torch <= 2.14 reads only TORCH_NCCL_DUMP_ON_TIMEOUT). (current name, the name before it, from version)
FLIGHT_RECORDER_NAMES = (
    ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", (2, 8)),
    ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", (2, 8)),
    ("TORCH_FR_DUMP_ON_TIMEOUT", "TORCH_NCCL_DUMP_ON_TIMEOUT", (2, 15)),
)


def flight_recorder_names(version: tuple[int, int] | None = None) -> dict[str, str]:
    """Each flight-recorder variable (by its current name) under the name `version`'s torch reads."""
    version = version or torch_version()
    return {current: current if version >= since else before for current, before, since in FLIGHT_RECORDER_NAMES}


# --- process groups -------------------------------------------------------------------------------------------


def set_default_group_timeout(timeout: datetime.timedelta) -> bool:
    """Give the default process group's later collectives `timeout`; False where this torch cannot.

    torch has no public way to change a live group's timeout; `distributed_c10d._set_pg_timeout` (2.4 to 2.13, the
    one torchtitan's set_pg_timeouts uses) does it. Without it, collectives keep the start-up timeout the group
    was made with (`dist.init_timeout_seconds`): a hung collective is then found later, by the hang watch.
    """
    set_timeout = _optional("torch.distributed.distributed_c10d", "_set_pg_timeout")
    if set_timeout is None:
        return False
    set_timeout(timeout, None)
    return True


def release_destroyed_groups() -> None:
    """Let the backends `destroy_process_group` forgot go now, while the interpreter is whole.

    destroy_process_group drops torch's table of groups, but a gloo backend and its threads (workers, TCP loop)
    live until the last reference to its group goes (gloo's `shutdown()` does nothing): after an FSDP run the
    reference cycles FSDP leaves, and from torch 2.11 every DeviceMesh (it holds its groups in `_pg_registry`),
    which DTensor's caches keep in every thread that ran a DTensor op. Measured with `kubetrain train --nproc 2`
    and FSDP: each rank still had its gloo threads when the program ended (2.8, 2.11 and 2.13), so the backend
    went during interpreter finalization, the window where a gloo thread that still touches Python is killed and
    aborts the process ("terminate called without an active exception", pytorch PR #179291). Here the cycles are
    collected and every mesh still alive lets go of its (destroyed) groups, so each backend is destroyed now,
    which joins its threads. Where a mesh has no `_pg_registry` (2.8: it holds group names), there is nothing to
    let go of; a torch that holds groups elsewhere keeps its backends to the end, as before.
    """
    import gc
    import sys

    gc.collect()
    mesh_module = sys.modules.get("torch.distributed.device_mesh")  # never imported: no mesh was made
    mesh_type = getattr(mesh_module, "DeviceMesh", None)
    if isinstance(mesh_type, type):
        for found in gc.get_objects():
            # issubclass of its type, not isinstance: from 2.13 DeviceMesh's metaclass (OpaqueBaseMeta) checks an
            # instance through its attributes, and `torch.distributed.reduce_op` warns (FutureWarning) when touched
            registry = getattr(found, "_pg_registry", None) if issubclass(type(found), mesh_type) else None
            if isinstance(registry, dict):
                registry.clear()
    gc.collect()


# --- FSDP and DCP -------------------------------------------------------------------------------------------


def checkpoint_activations(module: nn.Module) -> None:
    """Recompute `module`'s activations in backward instead of keeping them (non-reentrant, RNG-preserving).

    torch's composable `checkpoint` (`torch.distributed._composable`, 2.1 to 2.13) works through hooks, so
    parameter names, state dicts and FSDP's per-block wrapping do not change. Where it is gone, the block's
    forward is wrapped in the public `torch.utils.checkpoint.checkpoint`, which also keeps the names (the module
    is the same object); compiled blocks then recompute through the wrapper, the same result.
    """
    checkpoint = _optional("torch.distributed._composable", "checkpoint")
    if checkpoint is not None:
        checkpoint(module)
        return
    from torch.utils.checkpoint import checkpoint as recompute

    forward = module.forward

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return recompute(forward, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)

    module.forward = checkpointed


def local_shard_slices(param: torch.Tensor, shape: list[int]) -> tuple[slice, ...]:
    """Where this process's part of a DTensor lies in the whole tensor of `shape`.

    `torch.distributed.tensor._utils.compute_local_shape_and_global_offset` (2.4 to 2.13) answers it for every
    placement; where it is gone, FSDP2's only placement, Shard(0) on a 1-D mesh, is computed here the way
    torch.chunk splits dim 0 (what FSDP2 does), and any other layout is refused.
    """
    locate = _optional("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset")
    if locate is not None:
        local, offset = locate(shape, param.device_mesh, param.placements)  # type: ignore[attr-defined]
        return tuple(slice(start, start + n) for start, n in zip(offset, local, strict=True))
    from torch.distributed.tensor import Shard

    mesh, placements = param.device_mesh, param.placements  # type: ignore[attr-defined]
    if mesh.ndim != 1 or len(placements) != 1 or placements[0] != Shard(0):
        raise RuntimeError(f"this torch ({torch.__version__}) cannot locate a shard placed {placements}")
    size, parts, index = shape[0], mesh.size(), mesh.get_local_rank()
    chunk = -(-size // parts)
    start = min(size, chunk * index)
    return (slice(start, min(size, start + chunk)), *(slice(0, n) for n in shape[1:]))


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device and keep their buffers real.

    What accelerate's `init_empty_weights(include_buffers=False)` does: `nn.Module.register_parameter` (public,
    unchanged from 1.x to 2.13) is wrapped so each parameter moves to meta as it is registered, and no layer's
    default init runs on real memory. `with torch.device("meta")` would put the buffers (RoPE tables) on meta too.
    """
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]



def step_unless_found_inf(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """`optimizer.step()`, unless `found_inf` (a 0-dim float tensor on the parameters' device, 1.0 or 0.0) is set.

    Optimizers marked `_step_supports_amp_scaling` (fused Adam/AdamW, what optim.py builds on the CPU and CUDA; 2.8
    to 2.13) read the `found_inf` attribute GradScaler sets on them, in their kernel: a set flag leaves weights,
    moments and step counts as they were (the step count is raised and lowered again), with no host sync. Any other
    optimizer (foreach AdamW on MPS): the flag is read on the host (one sync per step), and the step is not taken.
    """
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        optimizer.found_inf = found_inf  # type: ignore[attr-defined]
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf  # type: ignore[attr-defined]
    elif not bool(found_inf):
        optimizer.step()


# --- kernels --------------------------------------------------------------------------------------------------


def flex_attention(device: torch.device) -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """`(flex_attention, create_block_mask)` where they are the fast path for attention over packed windows, else
    None (the caller then gives SDPA an explicit mask).

    FlexAttention (torch.nn.attention.flex_attention, public from 2.5) skips the blocks a document mask rules out,
    and holds a block mask of (T/128)^2 entries instead of a T x T one; it is fast only compiled, which Inductor
    does for CUDA (torchtitan's document masking runs it so). On the CPU eager FlexAttention is a reference
    implementation (the whole scores, slower than SDPA), and it takes no dropout: those get SDPA.
    """
    if device.type != "cuda":
        return None
    kernel = _optional("torch.nn.attention.flex_attention", "flex_attention")
    block_mask = _optional("torch.nn.attention.flex_attention", "create_block_mask")
    if kernel is None or block_mask is None:
        return None
    return _compiled(kernel), block_mask


_COMPILED: dict[Callable[..., Any], Callable[..., Any]] = {}


def _compiled(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function` compiled once per process (FlexAttention's kernel is generated by Inductor; eager it is not fast)."""
    if function not in _COMPILED:
        _COMPILED[function] = torch.compile(function)
    return _COMPILED[function]


# --- Dynamo ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class DynamoCounts:
    """What Dynamo did inside `dynamo_counts()`: graphs captured (one per frame traced without a break, before any
    split a backend makes) and graph breaks by reason (Dynamo's message)."""

    graphs: int = 0
    breaks: dict[str, int] = dataclasses.field(default_factory=dict)


@contextlib.contextmanager
def dynamo_counts() -> Iterator[DynamoCounts]:
    """Count Dynamo's graphs and graph breaks while inside (filled in on exit): the proof of a one-graph claim.

    Dynamo's process-wide `torch._dynamo.utils.counters` (2.0 to 2.13: `stats.unique_graphs`, `graph_break`) is read
    before and after. Where it is gone, nothing is counted (both stay 0): the tests that prove the claim then fail
    on their graph count, never pass by accident.
    """
    counters = _optional("torch._dynamo.utils", "counters")
    found = DynamoCounts()
    before = ({} if counters is None else dict(counters["graph_break"]),
              0 if counters is None else counters["stats"]["unique_graphs"])
    try:
        yield found
    finally:
        if counters is not None:
            found.graphs = counters["stats"]["unique_graphs"] - before[1]
            for reason, n in counters["graph_break"].items():
                if n > before[0].get(reason, 0):
                    found.breaks[reason] = n - before[0].get(reason, 0)


class _LocalAllGather:
    """FSDP2's all-gather without the peers: the same output buffer, filled with this rank's own shard."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> None:
        rows = output_tensor.view(-1, input_tensor.numel())
        rows.copy_(input_tensor.detach().clone().view(1, -1).expand_as(rows))


class _LocalReduceScatter:
    """FSDP2's reduce-scatter without the peers: the same buffers, this rank's own part of its own gradient."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any = None,
                 async_op: bool = False) -> None:
        output_tensor.copy_(input_tensor.view(-1, output_tensor.numel())[group.rank()])


def _fsdp_param_groups(module: nn.Module) -> list[Any] | None:
    """The parameter groups of an FSDP2 module's state (one per module up to 2.12, a list from 2.13), or None."""
    state = module._get_fsdp_state()  # type: ignore[operator]
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    if not all(hasattr(g, "_all_gather_comm") and hasattr(g, "_reduce_scatter_comm") for g in groups):
        return None
    return list(groups)


@contextlib.contextmanager
def fsdp_collectives_local(model: nn.Module) -> Iterator[bool]:
    """Inside, an FSDP2 model's forward and backward run without a collective: each all-gather and reduce-scatter
    is a rank-local stand-in with the same buffers (the same memory, meaningless numbers), and HSDP's all-reduce
    of gradients is off. A rank that runs out of memory there leaves no peer waiting in a collective. Yields True
    when so (or when `model` is not sharded: nothing to do); False where this torch lacks what it takes (then
    nothing is changed, and the step's collectives are FSDP's own).

    Needs FSDPModule's `set_custom_all_gather`/`set_custom_reduce_scatter` (public; what they replace is read back
    from the parameter groups' `_all_gather_comm`/`_reduce_scatter_comm` to restore it) and `reset_iter_state`
    (2.13: clears what a forward or backward cut short by an exception leaves behind), called on the way out.
    """
    fsdp = _optional("torch.distributed.fsdp", "FSDPModule")
    sharded = [m for m in model.modules() if fsdp is not None and isinstance(m, fsdp)]
    if not sharded:
        yield True
        return
    needed = ("set_custom_all_gather", "set_custom_reduce_scatter", "reset_iter_state", "set_requires_all_reduce")
    groups = {id(m): _fsdp_param_groups(m) for m in sharded}
    if not all(hasattr(fsdp, name) for name in needed) or any(g is None for g in groups.values()):
        yield False
        return
    saved = [(g, g._all_gather_comm, g._reduce_scatter_comm, g.all_reduce_grads)
             for m in sharded for g in groups[id(m)] or []]
    for module in sharded:
        module.set_custom_all_gather(_LocalAllGather())
        module.set_custom_reduce_scatter(_LocalReduceScatter())
        module.set_requires_all_reduce(False, recurse=False)
    try:
        yield True
    finally:
        sharded[0].reset_iter_state()  # the root: the first FSDP module of `model`
        for group, all_gather, reduce_scatter, all_reduce in saved:
            group._all_gather_comm, group._reduce_scatter_comm = all_gather, reduce_scatter
            group.all_reduce_grads = all_reduce

"""Parallelism applied from outside a single-device model, in one function and torchtitan's fixed order
(models/llama3/infra/parallelize.py): activation checkpointing per block, compile, then data parallelism — DDP,
FSDP2 over every process, or HSDP (FSDP2 on a 2-D mesh: shards within a node, replicas across nodes).

Under FSDP/HSDP the model is built with its parameters on the meta device, sharded, and only then materialised
(`to_empty`): each process allocates its own shard of every weight, never the whole model, and fills only that
shard (`ShardInit` draws it, `load_safetensors` reads it).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from kubetrain.config.schema import Config, DistConfig
from kubetrain.distributed.env import ProcessEnv
from kubetrain.errors import ConfigError
from kubetrain.torch_compat import checkpoint_activations, local_shard_slices, parameters_on_meta

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def parallelize(model: nn.Module, cfg: Config, world: ProcessEnv, device: torch.device, precision: str,
                compiled: bool = False) -> nn.Module:
    """The model as this world trains it, in a fixed order: activation checkpointing (our GPT; a Hugging Face
    model checkpoints itself), compile (`compiled`), then data parallelism.

    FSDP/HSDP (torchtitan's order): each block compiled, then fully_shard per block and at the root; the model
    may still be on the meta device (materialise it after). DDP and one process: nothing is compiled here; the
    training step compiles the model and its loss as one graph (train/loss.py `loss_step`; under DDP Dynamo splits
    it at DDP's buckets).
    """
    if cfg.model.gradient_checkpointing and cfg.model.kind == "gpt":
        checkpoint_blocks(model)
    if world.distributed and cfg.dist.shards_weights:
        if compiled:
            compile_blocks(model)
        return shard(model, device_mesh(cfg.dist, world, device), precision_plan(precision, sharded=True))
    if world.distributed:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return model


def compile_blocks(model: nn.Module, backend: str = "inductor") -> int:
    """Compile each transformer block in place; call it before fully_shard. Returns the blocks compiled.

    torchtitan (apply_compile) compiles every TransformerBlock after activation checkpointing and before FSDP: the
    blocks share one graph (compiled once, reused), and FSDP's all-gathers between blocks stay outside the compiled
    regions. In place (nn.Module.compile) rather than torch.compile(block), so parameter names keep no `_orig_mod.`
    and checkpoints load as before.
    """
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        return 0
    for block in blocks:
        block.compile(backend=backend)
    return len(blocks)


def checkpoint_blocks(model: nn.Module) -> int:
    """Recompute each block's activations in backward instead of keeping them; returns the blocks wrapped.

    torch's composable `checkpoint` works through hooks, so parameter names (and checkpoints) do not change.
    Non-reentrant and RNG-preserving: dropout masks are the same in the recomputation, so are the gradients.
    """
    blocks = list(getattr(model, "blocks", []))
    for block in blocks:
        checkpoint_activations(block)
    return len(blocks)


@dataclass(frozen=True)
class PrecisionPlan:
    """How a run in some precision computes: autocast around the forward, or FSDP's mixed-precision policy."""

    autocast: torch.dtype | None  # the dtype autocast runs the forward in; None: no autocast
    param_dtype: torch.dtype | None = None  # FSDP: the dtype weights are all-gathered and computed in
    reduce_dtype: torch.dtype | None = None  # FSDP: the dtype gradients are reduce-scattered in

    def policy(self) -> MixedPrecisionPolicy:
        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)


_HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


def precision_plan(precision: str, sharded: bool) -> PrecisionPlan:
    """bf16/fp16 without sharding: autocast. Under FSDP/HSDP: no autocast, FSDP's policy instead (torchtitan's):
    weights gathered and computed in the half dtype, gradients reduced in fp32. fp16 gathers in fp16 too; the
    loop's GradScaler works on FSDP2's DTensor gradients (DTensor all-reduces found_inf over the mesh)."""
    half = _HALF.get(precision)
    if half is None:
        return PrecisionPlan(autocast=None)
    if not sharded:
        return PrecisionPlan(autocast=half)
    return PrecisionPlan(autocast=None, param_dtype=half, reduce_dtype=torch.float32)


def mesh_shape(strategy: str, world_size: int, local_world_size: int, shard_size: int | None) -> tuple[int, ...]:
    """FSDP: one dimension of every process. HSDP: (replicas, shard group) with the shard group `shard_size`
    processes (default: one node's); it must divide the world size (bad input: one line, exit 2)."""
    if strategy != "hsdp":
        return (world_size,)
    size = shard_size or local_world_size
    if world_size % size:
        what = f"dist.shard_size {size}" if shard_size else f"the {size} processes per node (LOCAL_WORLD_SIZE)"
        raise ConfigError(f"hsdp: {what} must divide the world size {world_size}; set dist.shard_size to one of "
                          f"{[d for d in range(1, world_size + 1) if world_size % d == 0]}")
    return (world_size // size, size)


def device_mesh(cfg: DistConfig, world: ProcessEnv, device: torch.device) -> DeviceMesh:
    """torchtitan's data-parallel mesh (distributed/parallel_dims.py): ("dp_shard",) for FSDP,
    ("dp_replicate", "dp_shard") for HSDP. Ranks are laid out row-major, so a shard group is consecutive ranks:
    the processes of one node under torchrun. Collective: every rank calls it."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = mesh_shape(cfg.strategy, world.world_size, world.local_world_size, cfg.shard_size)
    names = ("dp_shard",) if len(shape) == 1 else ("dp_replicate", "dp_shard")
    return init_device_mesh(device.type, shape, mesh_dim_names=names)


def shard(model: nn.Module, mesh: DeviceMesh, precision: PrecisionPlan) -> nn.Module:
    """FSDP2 around each block, then the root (the embedding, final norm and head); works on meta parameters.

    On a 2-D mesh FSDP2 is HSDP: sharded over the mesh's last dimension, replicated over the first."""
    from torch.distributed.fsdp import fully_shard

    policy = precision.policy()
    for block in getattr(model, "blocks", []):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


params_on_meta = parameters_on_meta  # the meta build: torch_compat says why it wraps register_parameter


def materialise(model: nn.Module, device: torch.device) -> None:
    """Allocate this process's shards on `device` (uninitialised) and move the real buffers there."""
    buffers = {name: b for name, b in model.named_buffers() if b.device.type != "meta"}
    first: dict[int, str] = {}
    tied = {}  # alias -> the name it shares a parameter with
    for name, p in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(p), name) != name:
            tied[name] = first[id(p)]
    model.to_empty(device=device)
    for alias, name in tied.items():  # to_empty gives each module a new parameter: tie them again
        if model.get_parameter(alias) is not model.get_parameter(name):
            owner, _, attr = alias.rpartition(".")
            setattr(model.get_submodule(owner), attr, model.get_parameter(name))
    with torch.no_grad():
        for name, value in buffers.items():
            model.get_buffer(name).copy_(value)


def local_slices(param: torch.Tensor, shape: Sequence[int]) -> tuple[slice, ...]:
    """Where this process's part of `param` (a DTensor, or a plain tensor: all of it) lies in the whole tensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return tuple(slice(0, n) for n in shape)
    return local_shard_slices(param, list(shape))


class ShardInit:
    """Fills weights with their random init, drawn for this process's part only: init(name, param, kind, scale) with
    kind "normal" (std), "uniform" (bound) or "constant". The init of every fresh weight of a run (train/
    model_for_world.py), whatever its strategy: one process, DDP, FSDP and HSDP at any world size start alike.

    torchtitan draws on the sharded DTensors and lets DTensor's RNG tracker offset each shard; that tracker refuses
    the CPU (torch.distributed.tensor._random: "requires the presence of CUDA/CUDA-like"), where every rank would
    draw the same numbers for its own shard. Here each weight is cut into chunks of whole rows (about CHUNK
    elements), and chunk i of weight `name` comes from a CPU generator of its own, seeded by (seed, name, i), in
    fp32, then copied to the weight's device. A process draws only the chunks its rows overlap: its init work is
    its shard plus at most two chunks per weight, and it holds one chunk (256 KiB) beyond its shard meanwhile, so an
    8B model sharded 8 ways costs each process an eighth of the draws and no whole weight. The weights are the same
    at every world size and shard layout and on every device type, for the same seed; they are not those of a bare
    `GPT(cfg)` (its layers' own init, from the global RNG), and the global RNG is left untouched.
    """

    CHUNK = 1 << 16

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.drawn = 0  # elements drawn by this process (its init work)

    def __call__(self, name: str, param: torch.Tensor, kind: str, scale: float) -> None:
        from torch.distributed.tensor import DTensor

        local = param.to_local() if isinstance(param, DTensor) else param
        with torch.no_grad():
            if kind == "constant":
                local.fill_(scale)
                return
            shape = tuple(param.shape)
            where = local_slices(param, shape)
            if any((s.start, s.stop) != (0, n) for s, n in zip(where[1:], shape[1:], strict=True)):
                raise ValueError(f"{name}: only shards of whole rows can be initialised ({where})")
            rows, row_numel = where[0], math.prod(shape[1:])
            if rows.stop <= rows.start:  # more processes than rows: this one holds none
                return
            per_chunk = max(1, self.CHUNK // max(1, row_numel))
            for chunk in range(rows.start // per_chunk, -(-rows.stop // per_chunk)):
                start, stop = chunk * per_chunk, min((chunk + 1) * per_chunk, shape[0])
                generator = torch.Generator().manual_seed(self.chunk_seed(name, chunk))  # the CPU's, on any device
                block = torch.empty((stop - start, *shape[1:]), dtype=torch.float32)
                if kind == "normal":
                    block.normal_(0.0, scale, generator=generator)
                elif kind == "uniform":
                    block.uniform_(-scale, scale, generator=generator)
                else:
                    raise ValueError(f"unknown init {kind!r}")
                self.drawn += block.numel()
                lo, hi = max(start, rows.start), min(stop, rows.stop)
                local[lo - rows.start:hi - rows.start].copy_(block[lo - start:hi - start])

    def chunk_seed(self, name: str, chunk: int) -> int:
        digest = hashlib.blake2b(f"{self.seed}:{name}:{chunk}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def keep_part(param: torch.Tensor, whole: Any) -> None:
    """Copy this process's part of `whole` into `param` (its shard under FSDP, all of it otherwise).

    `whole` is a tensor, or a safetensors slice (`safe_open(...).get_slice(name)`): then only the part is read.
    """
    from torch.distributed.tensor import DTensor

    shape = whole.shape if isinstance(whole, torch.Tensor) else whole.get_shape()
    with torch.no_grad():
        local = param.to_local() if isinstance(param, DTensor) else param
        local.copy_(whole[local_slices(param, shape)])


def load_safetensors(model: nn.Module, files: Iterable[Path]) -> set[str]:
    """Copy each parameter's (and buffer's) part for this process out of safetensors files; the names found.

    Only the bytes of this process's shard are read, so no process holds a whole copy of the weights.
    Names that are not in the files keep their values, as load_state_dict(strict=False) does.
    """
    targets = {**dict(model.named_buffers()), **dict(model.named_parameters(remove_duplicate=False))}
    return load_safetensors_into(targets, files)


def load_safetensors_into(targets: dict[str, torch.Tensor], files: Iterable[Path]) -> set[str]:
    """load_safetensors into tensors named as the files name them (a LoRA base layer under its plain name)."""
    from safetensors import safe_open

    found: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - a safe_open handle has keys(), not iteration
                if name in targets:
                    keep_part(targets[name], f.get_slice(name))
                    found.add(name)
    return found


def return_freed_memory() -> bool:
    """Have glibc give large freed blocks back to the OS at once (a fixed mmap threshold of 1 MiB); True if set.

    FSDP on the CPU gathers each block's weights and frees them after use, every step. With glibc's default,
    the mmap threshold rises after the first such free (up to 32 MiB), later gathers come from the heap, and the
    freed heap stays resident: measured here, a 4-block GPT on 2 ranks peaked at 670 MiB per process instead
    of 469 MiB, and the gap grows with the model. Accelerators have their own allocator; this is the CPU's.
    """
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (macOS, musl): their allocators return memory their own way
        return False
    m_mmap_threshold = -3  # from malloc.h
    return bool(libc.mallopt(m_mmap_threshold, 1 << 20))


def tied_aliases(model: nn.Module) -> set[str]:
    """Names under which a parameter appears a second time (a tied head): checkpoints store it once."""
    first = {name for name, _ in model.named_parameters()}
    return {name for name, _ in model.named_parameters(remove_duplicate=False)} - first


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)

"""How much memory training a config takes, per process: the one estimate train, the launcher, doctor and render use.

A run's processes are laid out by `Layout` (strategy, world size, processes on one node). The estimate of one
process's training state (`estimate_memory`) divides by what the strategy shards over: nothing under DDP, the
world under FSDP, the node's processes under HSDP (sharded within a node, replicated across nodes). What a
device must then hold (`Estimate.device_need`) is one process's share on its own GPU, and all the node's
processes together on the CPU, whose RAM they share. Everything is made on the meta device: nothing is allocated.

Every process also holds memory before its first tensor: the interpreter, torch and kubetrain's imports (the
`runtime` part, measured below), on CUDA the context on its GPU; the launcher of `--nproc` holds its own runtime
beside its workers. The data loader's batches, a background checkpoint's host copy and the evaluation pass are
parts too, so that on the CPU the estimate is what the node's processes hold at most, together: bench/
bench_memory_estimate.py checks it against their measured peak resident memory (within 15%).

Who compares what: planning a node (the `--nproc` launcher, `kubetrain doctor`, `k8s render` for a pod's
request) compares `device_need` (and on GPU pods `host_need`); a worker that is already running compares what it
has still to allocate (`to_allocate`), since its runtime is already in place and its siblings may hold theirs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kubetrain import hardware
from kubetrain.config.schema import Config

MIB = 2**20
# Resident memory a CPU process holds before its first tensor, measured on torch 2.13.0+cpu (Python 3.11, Linux):
# the peak resident set (getrusage ru_maxrss, kubetrain/selftest/resident.py) of `kubetrain train` with a
# 1-layer GPT of width 8, block 8, micro-batch 1 and 3 steps, so that nearly all of it is the interpreter, torch,
# kubetrain's imports, data preparation and the process group: 356 MiB in one process, 344-361 MiB per worker under
# `--nproc 2` (DDP and FSDP, gloo). `import torch` alone is 221 MiB of it.
RUNTIME = 356 * MIB
# The `--nproc` launcher (torch.distributed.run's elastic agent in `kubetrain train`), measured the same way:
# 331-409 MiB over the bench's launched runs (bench/bench_memory_estimate.py); the larger is kept.
LAUNCHER_RUNTIME = 409 * MIB
# What glibc's malloc keeps resident after autograd frees the activations, as a share of them (CPU only): past its
# first free of a large block, malloc serves blocks below 32 MiB (one layer's activations) from its heap, whose
# holes it does not return to the kernel. Measured: a 4 x 256 GPT at 8 x 256 tokens (156 MiB of activations) peaks
# at 672 MiB resident, and at 572 MiB with MALLOC_MMAP_THRESHOLD_=131072 (every such block mapped and unmapped);
# across the bench's cases the difference is 0.48-0.64 of the activations. FSDP's workers showed none (545 MiB
# measured per worker of 4, 547 MiB estimated without it), for a reason not yet known: not counted there.
CPU_ALLOCATOR_RETAINED = 0.5
# What a Hugging Face model adds to a process's runtime: importing transformers and peft and a model's module
# (resident memory after them less before, in a process that had imported kubetrain's trainer): 131 MiB.
HF_RUNTIME = 131 * MIB
# A CUDA context on each process's GPU: the driver's state and torch's loaded kernels. Not seen by
# torch.cuda.memory_allocated (PyTorch's CUDA semantics notes: the context is not managed by the caching
# allocator); about 0.5 GiB with CUDA 12's lazy module loading, which loads only the kernels a run uses.
CUDA_CONTEXT = 512 * MIB
# Parts that a running process already holds when it checks what is free.
RUNTIME_PARTS = ("runtime", "cuda_context")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FUSED_ATTENTION = ("flash", "memory-efficient", "cudnn")

# Bytes autograd keeps per token in one block of our GPT (RMSNorm, q/k/v/o, rotary SDPA, SwiGLU): a·width +
# b·mlp_hidden, by (compiled, bytes of the compute dtype). Counted tensor by tensor with saved_tensors_hooks under
# autocast (tests/test_memory.py measures them again): eager bf16 keeps each norm's fp32 output (4h each), one
# bf16 cast of the attention's input and one of the MLP's (gpt.autocast_input: 4h), rotated q and k, v and the
# attention output (8h), and gate, up, silu and their product (8f). Compiled, Inductor's min-cut partitioner
# recomputes pointwise ops instead (20h + 6f). fp32 keeps no casts.
# Under torch 2.8 on CUDA nn.RMSNorm is not fused and keeps 4h more per norm (torch 2.9 added the fused kernel).
BLOCK_ACTIVATIONS: dict[tuple[bool, int], tuple[int, int]] = {
    (False, 2): (20, 8), (True, 2): (20, 6), (False, 4): (32, 16), (True, 4): (32, 12),
}


@dataclass(frozen=True)
class Layout:
    """Where a run's processes are: the strategy, how many there are, and how many share one node."""

    strategy: str  # dist.strategy: ddp, fsdp or hsdp
    world_size: int = 1
    local_processes: int = 1  # processes on one node: they share its RAM
    launcher: bool = False  # a launcher process (torch.distributed.run's agent) runs beside them on the node

    @classmethod
    def of(cls, cfg: Config, world_size: int = 1, local_processes: int | None = None,
           launcher: bool | None = None) -> Layout:
        """`cfg`'s strategy over `world_size` processes, `local_processes` of them per node (default: all);
        `launcher` default: when the node runs more than one process (`--nproc`)."""
        world = max(1, world_size)
        local = max(1, min(local_processes or world, world))
        return cls(str(cfg.dist.strategy), world, local, local > 1 if launcher is None else launcher)

    @classmethod
    def of_pods(cls, cfg: Config) -> Layout:
        """The layout `k8s render` gives the config: k8s.nnodes pods of k8s.nproc_per_node processes, each pod's
        started by its launcher (the entrypoint runs torch.distributed.run)."""
        procs = cfg.k8s.nproc_per_node
        return cls.of(cfg, cfg.k8s.nnodes * procs, procs, launcher=True)

    @property
    def sharded(self) -> bool:
        """Whether weights, gradients and optimizer state are sharded (FSDP2 or HSDP over more than one process)."""
        return self.world_size > 1 and self.strategy in ("fsdp", "hsdp")

    @property
    def shards(self) -> int:
        """Into how many pieces one copy of the training state is cut: the world (FSDP), the node (HSDP), 1 (DDP)."""
        if not self.sharded:
            return 1
        return self.world_size if self.strategy == "fsdp" else self.local_processes

    @property
    def name(self) -> str:
        return self.strategy if self.world_size > 1 else "single"


@dataclass(frozen=True)
class Estimate:
    """One process's training state on its device, and what a node of them needs."""

    layout: Layout
    device: str  # the device type the processes train on: cpu, cuda, mps
    parts: dict[str, int]  # bytes of one process, by part (weights, gradients, optimizer, ..., logits)
    params: int
    host_weights: int  # bytes of one whole copy of the weights on the host, as the model is built
    builds_on_meta: bool = False  # the model is built on the meta device and filled shard by shard (FSDP)
    host_runtime: int = RUNTIME  # one process's runtime in host memory (with a Hugging Face model's imports)
    host_staging: int = 0  # on GPUs: a background checkpoint's copy in host memory, of the process that stages most

    @property
    def per_process(self) -> int:
        """Bytes of the process that holds the most (rank 0, which alone stages an unsharded checkpoint)."""
        return sum(self.parts.values())

    @property
    def to_allocate(self) -> int:
        """What a running process has still to allocate: its estimate less the runtime it already holds."""
        return self.per_process - sum(self.parts.get(name, 0) for name in RUNTIME_PARTS)

    @property
    def device_need(self) -> int:
        """Bytes one device must hold: a process's share on its own GPU; on the CPU every local process's and the
        launcher's runtime (an unsharded checkpoint is staged by rank 0 alone, a sharded one by every rank)."""
        if self.device != "cpu":
            return self.per_process
        local = self.layout.local_processes
        staged_once = 0 if self.layout.sharded else self.parts.get("checkpoint_staging", 0)
        return local * self.per_process - (local - 1) * staged_once + self.launcher_runtime

    @property
    def launcher_runtime(self) -> int:
        return LAUNCHER_RUNTIME if self.layout.launcher else 0

    @property
    def host_copies(self) -> int:
        """Whole copies of the weights a node's processes hold in host memory while the model is built on GPUs:
        each process builds it on the CPU, unless the model is built on the meta device and sharded (one copy
        then, rank 0's when it gathers the weights to save)."""
        return 1 if self.layout.sharded and self.builds_on_meta else self.layout.local_processes

    @property
    def host_need(self) -> int:
        """Bytes of host memory one node needs: the training state on the CPU; with GPUs the weights' copies and
        every process's runtime (a CUDA torch's is larger: this is the least)."""
        if self.device == "cpu":
            return self.device_need
        local = self.layout.local_processes
        staged = self.host_staging * (local if self.layout.sharded else 1)  # unsharded: rank 0 alone
        return self.host_copies * self.host_weights + local * self.host_runtime + self.launcher_runtime + staged

    def to_json(self) -> dict[str, Any]:
        lay = self.layout
        return {"estimate": self.per_process, "parts": dict(self.parts), "params": self.params,
                "world_size": lay.world_size, "local_processes": lay.local_processes, "strategy": lay.name,
                "shards": lay.shards, "device_need": self.device_need, "host_need": self.host_need}


def estimate(cfg: Config, shape: dict[str, Any], layout: Layout, device: str, *, precision: str,
             attention: str | None, compiled: bool | None = None) -> Estimate:
    """The estimate of `cfg` (its `model_shape`) laid out as `layout`, training on `device` (a device type);
    `compiled` None: as `train.compile` decides on that device type (`hardware.choose_compile`)."""
    from kubetrain.models import builds_on_meta

    if compiled is None:
        compiled = hardware.choose_compile(cfg.train.compile, device).enabled
    parts = estimate_memory(cfg, shape, layout, precision=precision, attention=attention, compiled=compiled)
    mask = document_mask_bytes(cfg, device, precision)
    if mask:
        parts["document_mask"] = mask
    runtime = RUNTIME + (HF_RUNTIME if cfg.model.kind == "hf" else 0)
    staging = 0 if device == "cpu" else parts.pop("checkpoint_staging", 0)  # a GPU's copy goes to host memory
    if device == "cpu":
        retained = 0.0 if layout.sharded else CPU_ALLOCATOR_RETAINED
        parts |= {"allocator": int(retained * parts["activations"]), "runtime": runtime}
    elif device == "cuda":
        parts["cuda_context"] = CUDA_CONTEXT
    return Estimate(layout, device, parts, shape["params"], shape["params"] * shape["weight_bytes"],
                    builds_on_meta(cfg.model), runtime, staging)


def document_mask_bytes(cfg: Config, device: str, precision: str) -> int:
    """The attention mask a packed micro-batch builds (models/documents.py), kept through the backward: our GPT's
    boolean (B, 1, T, T) and its additive copy in the compute dtype, none on CUDA (FlexAttention's block mask is
    (T/128)^2 per window); a Hugging Face model's, which transformers builds for sdpa and eager (boolean)."""
    from kubetrain.data.shards import documents

    if not documents(cfg):
        return 0
    pairs = cfg.train.micro_batch * cfg.model.block_size ** 2
    if cfg.model.kind == "hf":
        return pairs
    return 0 if device == "cuda" else pairs * (1 + (2 if precision in ("bf16", "fp16") else 4))


def estimate_on(cfg: Config, layout: Layout, device: torch.device) -> Estimate | str:
    """The estimate for training on `device` here: the precision the loop would choose and the first attention
    kernel that runs (what `kubetrain doctor` reports); a string says why there is none."""
    shape = model_shape(cfg)
    if "error" in shape:
        return str(shape["error"])
    precision = hardware.choose_precision(cfg.train.precision, hardware.accelerator(device)).name
    attention = first_usable(hardware.sdpa_backends(device, DTYPES[precision], shape["head_dim"], shape["n_head"]))
    compiled = hardware.compile_choice(cfg.train.compile, device).enabled
    return estimate(cfg, shape, layout, device.type, precision=precision, attention=attention, compiled=compiled)


def first_usable(backends: dict[str, str]) -> str | None:
    """The attention kernel SDPA would pick among those that ran (`hardware.sdpa_backends`)."""
    return next((name for name in hardware.SDPA_BACKENDS if backends[name] == "ok"), None)


def estimate_memory(cfg: Config, shape: dict[str, Any], layout: Layout, *, precision: str,
                    attention: str | None, compiled: bool = False) -> dict[str, int]:
    """Peak training memory of one process in bytes, by part: a pure function of the config, the model's shape
    (`model_shape`), the processes' layout, the precision, the attention kernel and whether the step is compiled.

    The peak is at the start of the backward pass, in the head's backward: every activation is still kept, with
    the logits and their gradient. Weights and AdamW's two moments are whole in every process under DDP, which
    also keeps its gradient buckets; sharded (FSDP, HSDP) they are divided by `layout.shards`, plus the weights
    gathered at a time (the root's embedding and head, two blocks: the running one and the prefetched one, in the
    compute dtype, and one block's unsharded gradient). Gradients at the peak: the head's (the embedding's when
    tied), fp32; the others appear as activations are freed, and are whole at the optimizer step (or during a
    gradient accumulation), which is the peak when activations are small. Autocast keeps a half copy of each weight
    it casts.
    Activations: our GPT's blocks as counted in BLOCK_ACTIVATIONS, a Hugging Face model's after Korthikanti et al.
    2022 (34·s·b·h bytes per layer in 16 bit); plus 5·a·s²·b without a fused attention kernel; with gradient
    checkpointing only each block's fp32 input is kept, and one block is recomputed at a time. Compiled, the loss
    keeps the logits in the compute dtype (Inductor writes their gradient over them); eager, the head is fused with
    the loss (models/loss.py LinearCrossEntropy): the hidden states' gradient and one fp32 chunk at a time, never
    the whole logits; the head's fp32 gradient is counted with the gradients (under FSDP/HSDP whole, as
    `head_gradient`: the fused head makes it unsharded).
    """
    from kubetrain.models.loss import chunk_tokens

    b, s, layers, h, vocab = (cfg.train.micro_batch, cfg.model.block_size, shape["n_layer"],
                              shape["hidden"], shape["vocab"])
    tokens = b * s
    params, weight_bytes = shape["params"], shape["weight_bytes"]
    trainable = 0 if cfg.model.lora is not None else params  # LoRA: the adapters are a rounding error
    act = 2 if precision in ("bf16", "fp16") else 4
    tied = shape.get("tied", True)
    head = vocab * h
    if "mlp_hidden" in shape:  # our GPT: counted tensor by tensor
        per_h, per_f = BLOCK_ACTIVATIONS[(compiled, act)]
        per_layer = tokens * (per_h * h + per_f * shape["mlp_hidden"] + 4 * shape["n_head"] + 8)
    else:
        per_layer = 34 * tokens * h * act // 2
    if attention not in FUSED_ATTENTION:
        per_layer += 5 * shape["n_head"] * s * tokens * act // 2
    checkpointed = cfg.model.gradient_checkpointing
    activations = (layers * tokens * h * 4 + per_layer) if checkpointed else layers * per_layer
    activations += tokens * h * (4 + act)  # the final norm's output and the head's input
    half_weights = params * 2 if act == 2 and weight_bytes == 4 and not layout.sharded else 0
    # the dtype the layers compute in: autocast's (unsharded), FSDP's gathered weights' (sharded)
    compute = (2 if act == 2 else weight_bytes) if layout.sharded else act
    # compiled: the logits in the compute dtype (Inductor writes their gradient over them); eager: the head fused
    # with the loss (LinearCrossEntropy): the hidden states' gradient (fp32 under autocast, whose norms give fp32),
    # their copy in the compute dtype, and one chunk's logits: the product in the compute dtype and its fp32 copy,
    # then the softmax's gradient written over that copy, and its cast back for the hidden states' matmul
    hidden_bytes = compute if layout.sharded else 4
    cast = compute if compute < hidden_bytes else 0
    chunk = min(tokens, chunk_tokens(vocab)) * vocab * (4 + (compute if compute < 4 else 0))
    fused = tokens * (h * (hidden_bytes + cast) + 8) + chunk
    loss = tokens * vocab * act if compiled else fused
    # Gradients: whole from the second micro-batch of an accumulation on, else the head's at the activations'
    # peak, and whole at the optimizer step, once activations, logits and autocast's copies are gone.
    gradients = trainable * 4
    # eager, the fused head makes its weight's whole fp32 gradient in its forward pass, and hands it over in the
    # weight's dtype in its backward: under FSDP that is the gathered head's, unsharded (the root's gradients are
    # reduce-scattered after every block's backward), not a shard of it
    fused_head = layout.sharded and not compiled and trainable > 0
    head_gradient = head * (4 + (compute if compute < 4 else 0)) if fused_head else 0
    if cfg.train.grad_accum_steps == 1:
        at_peak = 0 if fused_head else head * 4 if trainable else 0
        gradients = max(at_peak, gradients - (activations + loss + half_weights))
    parts = {"weights": params * weight_bytes, "gradients": gradients, "optimizer": trainable * 8}
    if layout.sharded:
        block = max(0, params - head * (1 if tied else 2)) // max(1, layers)
        parts = {k: -(-v // layout.shards) for k, v in parts.items()}
        parts["gathered"] = (head * (1 if tied else 2) + 2 * block) * compute + (block * 4 if trainable else 0)
        if head_gradient:
            parts["head_gradient"] = head_gradient
    else:
        if half_weights:
            parts["half_weights"] = half_weights  # autocast's copies, kept for the backward
        if layout.world_size > 1:
            parts["ddp_buckets"] = trainable * 4
    parts |= {"activations": activations, "loss": loss}
    return parts | other_parts(cfg, parts, tokens, vocab, act, compiled)


def other_parts(cfg: Config, parts: dict[str, int], tokens: int, vocab: int, act: int, compiled: bool
                ) -> dict[str, int]:
    """Beside the step's tensors: the data loader's batches, a background checkpoint's host copy, the eval pass.

    The loader holds one micro-batch of int64 input ids and labels, and its copy on the device (the next one is
    read after the step). With checkpoint.async_save the weights and the optimizer's state are copied to host
    memory while the next step runs (write.stage; each rank its shards when sharded). The evaluation runs after
    the optimizer step has freed the gradients, without autograd: one micro-batch's logits compiled, one fp32 chunk
    of them eager; it is a part only where it exceeds the training step's peak (a model whose gradients are small
    beside a large vocabulary's logits)."""
    from kubetrain.models.loss import chunk_tokens

    extra = {"data": 2 * tokens * 8 * 2}
    if cfg.checkpoint.async_save:
        extra["checkpoint_staging"] = parts["weights"] + parts["optimizer"]
    # compiled: the plain loss's logits; eager: the fused head's chunks (no gradient is made without autograd)
    evaluation = tokens * vocab * act if compiled else 2 * min(tokens, chunk_tokens(vocab)) * vocab * 4
    step = (parts["gradients"] + parts["activations"] + parts["loss"] + parts.get("half_weights", 0)
            + parts.get("head_gradient", 0))
    if evaluation > step:
        extra["eval"] = evaluation - step
    return extra


def what_to_change(parts: dict[str, int], layout: Layout | None = None) -> str:
    """The settings that shrink the largest part of the estimate."""
    largest = max(parts, key=lambda name: parts[name])
    if largest in RUNTIME_PARTS:  # what each process holds before its first tensor: only fewer processes help
        return "run fewer processes per node (--nproc, k8s.nproc_per_node)"
    if largest in ("activations", "loss"):
        return ("lower train.micro_batch_size (raise train.grad_accum_steps to keep the batch) or "
                "model.block_size, or set model.gradient_checkpointing=true")
    if layout is not None and layout.sharded:
        return "use a smaller model, train LoRA adapters (model.lora), or shard it over more processes"
    return "use a smaller model, train LoRA adapters (model.lora), or shard it over GPUs with dist.strategy=fsdp"


def model_shape(cfg: Config) -> dict[str, Any]:
    """Parameters, layers, width, heads and vocabulary of the config's model, built on the meta device."""
    if cfg.model.kind == "hf":
        return _hf_shape(cfg)
    from kubetrain.models import gpt_config

    vocab = _tokenizer_vocab(cfg)
    if vocab is None and cfg.model.vocab_size is None:
        return {"error": f"the vocabulary of the {cfg.data.tokenizer.kind} tokenizer is known after prepare; "
                         "set model.vocab_size for an estimate"}
    gc = gpt_config(cfg.model, vocab or cfg.model.vocab_size or 0)
    return {"params": gc.parameters, "n_layer": gc.n_layer, "hidden": gc.n_embd, "n_head": gc.n_head,
            "head_dim": gc.head_dim, "vocab": gc.vocab_size, "weight_bytes": 4, "tied": gc.tie_embeddings,
            "mlp_hidden": gc.hidden}


def _tokenizer_vocab(cfg: Config) -> int | None:
    tok = cfg.data.tokenizer
    if tok.kind == "byte":
        return 256
    if tok.kind == "bpe":
        return tok.vocab_size
    from kubetrain.data.tokenizers import build_tokenizer
    from kubetrain.errors import DataError

    try:
        return build_tokenizer(tok).vocab_size
    except DataError:
        return None


def _hf_shape(cfg: Config) -> dict[str, Any]:
    folder = Path(cfg.model.name_or_path or "").expanduser()
    if not (folder / "config.json").is_file():
        return {"error": f"no config.json in {folder}: the model's size is not known here"}
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(hf).parameters())
    n_head = hf.num_attention_heads
    weight_bytes = 2 if cfg.model.dtype in ("bfloat16", "float16") else 4
    return {"params": params, "n_layer": hf.num_hidden_layers, "hidden": hf.hidden_size, "n_head": n_head,
            "head_dim": getattr(hf, "head_dim", None) or hf.hidden_size // n_head, "vocab": hf.vocab_size,
            "weight_bytes": weight_bytes, "tied": bool(getattr(hf, "tie_word_embeddings", False))}

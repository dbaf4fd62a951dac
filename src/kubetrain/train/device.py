"""Device facts and choices the loop needs: torch settings, mixed precision, peak FLOPS and FLOPs for MFU, memory.

Every choice that needs no device is a pure function of plain values (tested on the CPU); the few lines that
apply one to torch are kept apart. Where a CUDA path follows torchtitan, nanoGPT or litgpt, the comment says so.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import resource
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from kubetrain import hardware
from kubetrain.config.schema import Config
from kubetrain.distributed.parallelize import precision_plan
from kubetrain.errors import UserInputError


@dataclass(frozen=True)
class Peak:
    """Dense peak FLOP/s of one device: bf16/fp16 tensor cores, TF32 tensor cores (None: none), plain fp32."""

    bf16: float
    tf32: float | None
    fp32: float


# Dense (no sparsity) peaks from the vendors' data sheets, per device as torch sees it. The bf16 column follows
# torchtitan's get_peak_flops (torchtitan/tools/utils.py): H100 SXM 989, NVL 835, PCIe 756, H200 989, B200 2250,
# MI250X 191.5 per GCD (torch sees each of its two dies as one device), L40S 362. Keys are whole model names:
# "L4" must not match an L40, nor "A10" an A10G (an A10G has no published dense peak, so no MFU is shown).
# A T4 and a V100 have no bf16 tensor cores: their "bf16" column is the fp16 peak they train at (fp16 + scaler).
PEAK_FLOPS: dict[str, Peak] = {
    "B200": Peak(2250e12, 1100e12, 75e12),
    "H200 NVL": Peak(835e12, 418e12, 60e12),
    "H200": Peak(989e12, 494e12, 67e12),
    "H100 NVL": Peak(835e12, 418e12, 60e12),
    "H100 PCIe": Peak(756e12, 378e12, 51e12),
    "H100": Peak(989e12, 494e12, 67e12),  # SXM and other variants, as torchtitan
    "A100": Peak(312e12, 156e12, 19.5e12),
    "A10": Peak(125e12, 62.5e12, 31.2e12),
    "L40S": Peak(362e12, 183e12, 91.6e12),
    "L40": Peak(181e12, 90.5e12, 90.5e12),
    "L4": Peak(121e12, 60e12, 30.3e12),
    "RTX 4090": Peak(165e12, 82.6e12, 82.6e12),
    "RTX 3090": Peak(71e12, 35.6e12, 35.6e12),
    "V100": Peak(125e12, None, 15.7e12),
    "T4": Peak(65e12, None, 8.1e12),
    "MI300X": Peak(1307e12, 654e12, 163e12),
    "MI250X": Peak(191.5e12, None, 47.9e12),
}

# --- the device ---------------------------------------------------------------------------------------------


def device_request_problem(requested: str, cuda_available: bool, cuda_built: bool, torch_version: str) -> str | None:
    """Why `run.device` cannot be honoured by this torch (None: it can). 'auto' always can."""
    if requested == "cuda" and not cuda_available:
        built = "no visible GPU" if cuda_built else "a CPU-only build"
        return (f"run.device is 'cuda' but this torch ({torch_version}) has {built}; install a CUDA build of "
                "torch, or set run.device: auto")
    return None


def _gpu_build() -> bool:
    return torch.version.cuda is not None or torch.version.hip is not None  # ROCm builds answer to "cuda" too


@dataclass(frozen=True)
class DeviceFacts:
    """What choosing a device reads about this machine: stated (tests) or read here (`DeviceFacts.here()`)."""

    cuda_available: bool
    gpu_build: bool  # a CUDA or ROCm build of torch
    visible_gpus: int
    mps_available: bool
    local_rank: int = 0  # torchrun's LOCAL_RANK: which of the node's GPUs a worker takes

    @classmethod
    def here(cls) -> DeviceFacts:
        """This process's facts; reading them makes no CUDA context (is_available and device_count do not)."""
        return cls(torch.cuda.is_available(), _gpu_build(), torch.cuda.device_count(),
                   torch.backends.mps.is_available(), int(os.environ.get("LOCAL_RANK", "0")))


def choose_device(requested: str, facts: DeviceFacts) -> torch.device:
    """The device a process asking for `run.device: requested` trains on: cuda:LOCAL_RANK under a launcher, else
    the first one available; a request this torch cannot honour is bad input (exit 2)."""
    problem = device_request_problem(requested, facts.cuda_available, facts.gpu_build, torch.__version__)
    if problem is None and requested == "mps" and not facts.mps_available:
        problem = "run.device is 'mps' but this machine has no Metal GPU; set run.device: auto"
    if problem:
        raise UserInputError(problem)
    if requested == "cuda" or (requested == "auto" and facts.cuda_available):
        return torch.device("cuda", facts.local_rank % max(1, facts.visible_gpus))
    if requested == "mps" or (requested == "auto" and facts.mps_available):
        return torch.device("mps")
    return torch.device("cpu")


def select_device(requested: str) -> torch.device:
    """The device this process trains on (`choose_device` with this machine's facts)."""
    return choose_device(requested, DeviceFacts.here())


def process_count_problem(nproc: int, device_type: str, visible_gpus: int) -> str | None:
    """Why `--nproc` processes cannot each have a GPU (None: they can, or they train on the CPU)."""
    if device_type == "cuda" and nproc > visible_gpus:
        return (f"--nproc {nproc} is more than the {visible_gpus} GPU(s) visible here: two processes would share "
                f"a GPU and NCCL refuses that; use --nproc {visible_gpus} or fewer, or set run.device: cpu")
    return None


def check_process_count(requested_device: str, nproc: int, facts: DeviceFacts | None = None) -> torch.device:
    """The device of `nproc` local processes (the first's); refuse (exit 2) more processes than visible GPUs,
    before any process starts."""
    facts = facts or DeviceFacts.here()
    device = choose_device(requested_device, facts)
    if problem := process_count_problem(nproc, device.type, facts.visible_gpus):
        raise UserInputError(problem)
    return device


def device_name(device: torch.device) -> str:
    """What the run trains on, for meta.json: the GPU's model name, or the CPU's."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type}: {platform.processor() or platform.machine()}"


# --- torch settings: TF32 and determinism --------------------------------------------------------------------


def deterministic_for(requested: bool | None, device_type: str) -> bool:
    """Deterministic kernels: as asked; by default on the CPU (exact, bitwise resume) and off on a GPU.

    On CUDA determinism costs speed (no atomics in scatter/index backward, a fixed cuBLAS workspace), so it is
    only on when asked for, as in torchtitan (`debug.deterministic`, default false).
    """
    return requested if requested is not None else device_type != "cuda"


@dataclass(frozen=True)
class TorchSettings:
    """What `apply_torch_settings` sets: decided from the config and the device type alone."""

    deterministic: bool
    tf32: bool  # TF32 tensor cores for fp32 matmuls and convolutions (CUDA only)
    env: dict[str, str]
    fill_uninitialized_memory: bool


def torch_settings(cfg: Config, device_type: str) -> TorchSettings:
    """The torch settings of a run of `cfg` on `device_type`."""
    deterministic = deterministic_for(cfg.train.deterministic, device_type)
    cuda = device_type == "cuda"
    # torchtitan (distributed/utils.py set_determinism): a fixed cuBLAS workspace makes its GEMMs repeatable;
    # NaN-filling every torch.empty costs a kernel per allocation and proves nothing about a valid program.
    env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"} if deterministic and cuda else {}
    return TorchSettings(deterministic=deterministic, tf32=cuda and cfg.train.tf32, env=env,
                         fill_uninitialized_memory=not cuda)


# torch's alert for a kernel without a deterministic version reads "<kernel> does not have a deterministic
# implementation, but you set 'torch.use_deterministic_algorithms(True, warn_only=True)'..."
NONDETERMINISTIC_ALERT = r".*does not have a deterministic implementation.*"


def apply_torch_settings(cfg: Config, device: torch.device) -> TorchSettings:
    """Threads, seed, TF32 and determinism for this process; call before the first CUDA kernel."""
    settings = torch_settings(cfg, device.type)
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    for name, value in settings.env.items():
        os.environ.setdefault(name, value)  # read when cuBLAS makes its first handle
    if device.type == "cuda":
        # nanoGPT (train.py) and litgpt: TF32 for fp32 matmuls on Ampere and later. Only on CUDA: the CPU's
        # oneDNN would take "high" fp32 precision too and the CPU's bitwise guarantee would go.
        torch.backends.cuda.matmul.allow_tf32 = settings.tf32
        torch.backends.cudnn.allow_tf32 = settings.tf32
        torch.backends.cudnn.deterministic = settings.deterministic
        torch.backends.cudnn.benchmark = False
    if settings.deterministic:
        # warn_only: a kernel with no deterministic version still runs, and is named once (not once per step)
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = settings.fill_uninitialized_memory  # type: ignore[attr-defined]
        warnings.filterwarnings("once", message=NONDETERMINISTIC_ALERT)
    else:
        torch.use_deterministic_algorithms(False)
    torch.manual_seed(cfg.run.seed)
    return settings


# --- precision -----------------------------------------------------------------------------------------------


def resolve_precision(precision: str, device: torch.device) -> str:
    """The precision a run asking for `precision` trains in on `device` (hardware.choose_precision decides)."""
    return hardware.choose_precision(precision, hardware.accelerator(device)).name


def hf_weight_dtype(cfg: Config, precision: str) -> str:
    """The dtype a Hugging Face model's weights load in: `model.dtype`, with 'auto' decided here.

    auto is the training precision for a frozen base (LoRA), loaded straight in it (no fp32 copy on the host;
    under FSDP/HSDP each process loads its shards of it, and the policy gathers in that dtype): its weights never
    take an optimizer step, and the adapters PEFT adds stay fp32. A fully trained model keeps fp32 weights (AdamW
    steps on bf16 weights lose the small updates; autocast or FSDP's policy does the bf16 compute), and so do
    LoRA's modules_to_save (trained in full).
    """
    requested = cfg.model.dtype
    if requested != "auto" or cfg.model.kind != "hf":
        return requested if requested != "auto" else "float32"
    lora = cfg.model.lora
    if lora is not None and not lora.modules_to_save and precision in ("bf16", "fp16"):
        return "bfloat16" if precision == "bf16" else "float16"
    return "float32"


def autocast(precision: str, device: torch.device, sharded: bool = False
             ) -> Callable[[], contextlib.AbstractContextManager[None]]:
    """A factory of the autocast context for one forward pass: none in fp32, nor under FSDP/HSDP, whose
    mixed-precision policy computes in the half dtype instead (parallelize.precision_plan decides)."""
    dtype = precision_plan(precision, sharded).autocast
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)


# --- MFU: the peak and the FLOPs ----------------------------------------------------------------------------


def peak_flops_of(name: str, precision: str = "bf16", tf32: bool = True) -> float | None:
    """The dense peak of a device by its name ("NVIDIA H100 80GB HBM3") for a run in `precision`.

    Whole model names only, the longest first ("H100 PCIe" before "H100"). An fp32 run is measured against
    the TF32 peak when TF32 is on and the device has it, else against the plain fp32 peak.
    """
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])", name):
            peak = PEAK_FLOPS[key]
            if precision in ("bf16", "fp16"):
                return peak.bf16
            return peak.tf32 if tf32 and peak.tf32 is not None else peak.fp32
    return None


def peak_flops(device: torch.device, precision: str = "bf16", tf32: bool = True) -> float | None:
    if device.type != "cuda":
        return None
    return peak_flops_of(torch.cuda.get_device_name(device), precision, tf32)


def training_flops_per_token(matmul_params: int, trainable_matmul_params: int, n_layer: int, width: int,
                             seq_len: int) -> float:
    """FLOPs of one trained token: forward, input gradients and weight gradients of the matmuls, plus attention.

    nanoGPT's estimate_mfu (PaLM app. B) is 6N + 12LHQT: 2N forward, 2N for the gradient of the inputs, 2N for
    the gradient of the weights. A frozen weight (LoRA's base) gets no weight gradient: 4N + 2N_trainable.
    """
    return 4.0 * matmul_params + 2.0 * trainable_matmul_params + 12.0 * n_layer * width * seq_len


def matmul_params(model: nn.Module) -> tuple[int, int]:
    """(all, trainable) weights that take part in a matmul: every 2-D weight but an embedding table's.

    A tied lm_head counts (it is a matmul over the embedding's weight); LoRA's A and B count as trainable. Only
    a module's own weight counts: PEFT's LoRA layer also shows its base layer's weight as `.weight`.
    """
    total = trainable = 0
    for module in model.modules():
        weight = module._parameters.get("weight")
        if isinstance(module, nn.Embedding) or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            continue
        total += weight.numel()
        trainable += weight.numel() if weight.requires_grad else 0
    return total, trainable


def depth_and_width(model: nn.Module) -> tuple[int, int]:
    """(layers, hidden size) from our GPT's config or a Hugging Face config, for the attention FLOPs."""
    for module in model.modules():
        c = getattr(module, "hf_config", None) or getattr(module, "config", None)
        layers = getattr(c, "n_layer", None) or getattr(c, "num_hidden_layers", None)
        width = getattr(c, "n_embd", None) or getattr(c, "hidden_size", None)
        if isinstance(layers, int) and isinstance(width, int):
            return layers, width
    return 0, 0


def model_flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token of this (single-device) model at this sequence length."""
    total, trainable = matmul_params(model)
    layers, width = depth_and_width(model)
    return training_flops_per_token(total, trainable, layers, width, seq_len)


# --- out of memory ------------------------------------------------------------------------------------------


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or the CPU allocator's refusal (a RuntimeError that says so)."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(error))


def out_of_memory_advice(cfg: Config, device_type: str, where: str, world_size: int) -> str:
    """One line for a run that ran out of memory `where` ("after step 12"), and the settings that need less."""
    t, what = cfg.train, "CUDA out of memory" if device_type == "cuda" else "out of memory"
    fixes = []
    if t.micro_batch > 1:
        fixes.append(f"lower train.micro_batch_size ({t.micro_batch}; raise train.grad_accum_steps to keep "
                     "the batch)")
    if not cfg.model.gradient_checkpointing:
        fixes.append("set model.gradient_checkpointing: true")
    if not cfg.dist.shards_weights:
        fixes.append("shard weights and optimizer state with dist.strategy: fsdp" +
                     (" over more GPUs" if world_size == 1 else ""))
    if t.precision == "fp32" and device_type == "cuda":
        fixes.append("train in precision auto (bf16/fp16)")
    if cfg.model.lora is None and cfg.model.kind == "hf":
        fixes.append("fine-tune with model.lora")
    if not fixes:
        fixes.append("use a smaller model.block_size or more GPUs")
    advice = ", or ".join([", ".join(fixes[:-1]), fixes[-1]] if len(fixes) > 1 else fixes)
    return (f"{what} {where}: {advice} (`kubetrain doctor CONFIG` estimates the need); "
            "the checkpoints written so far are kept")


# --- memory ---------------------------------------------------------------------------------------------------


class MemoryPeak:
    """The peak memory of this process since the last reading (each log line shows its own window's peak).

    CUDA: the allocator's peak, then reset_peak_memory_stats. CPU (Linux): the largest resident set seen by
    `sample()` (once per step) or at the reading, from /proc/self/statm. Not by resetting the kernel's high-water
    mark (writing 5 to /proc/self/clear_refs): that would also erase the peak that getrusage, `time -f %M`, the
    benchmarks and the tests read from outside. Elsewhere: the process's max RSS since it started.
    """

    def __init__(self, device: torch.device, proc: Path = Path("/proc/self")) -> None:
        self.device, self.proc = device, proc
        self.window_peak = 0  # bytes, CPU

    def sample(self) -> None:
        """CPU: note the resident memory now (one small read); CUDA keeps its own peak."""
        if self.device.type != "cuda":
            self.window_peak = max(self.window_peak, self._rss() or 0)

    def read_and_reset(self) -> float:
        """GiB at the peak since the previous call (or the start)."""
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return peak / 2**30
        rss = self._rss()
        if rss is None:
            maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            return maxrss / 2**30 if sys.platform == "darwin" else maxrss / 2**20
        peak, self.window_peak = max(self.window_peak, rss), 0
        return peak / 2**30

    def _rss(self) -> int | None:
        try:
            pages = int((self.proc / "statm").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            return None
        return pages * os.sysconf("SC_PAGE_SIZE")


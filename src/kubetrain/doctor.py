"""`kubetrain doctor [CONFIG]`: can this machine run this config, and what would a run here pick?

No cluster needed: the device and its memory, bf16, the attention kernels usable for the config's head size
and dtype, versions, free disk where the run writes, the optional extras installed; with a config, an
estimate of the training memory against the memory free, and the settings a run here would use.
"""

from __future__ import annotations

import json
import re
import shutil
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from kubetrain import hardware
from kubetrain.config.schema import Config

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def doctor(cfg: Config | None, world_size: int = 1) -> dict[str, Any]:
    """The whole report as plain data (what --json prints); the memory estimate is per process of `world_size`."""
    from kubetrain.train.device import select_device

    device = select_device(cfg.run.device if cfg else "auto")
    # the same function the loop asks, so "bf16: no" never stands beside "precision bf16" unexplained
    choice = hardware.choose_precision(cfg.train.precision if cfg else "auto", hardware.accelerator(device))
    precision = choice.name
    shape = model_shape(cfg) if cfg else None
    head_dim, n_head = (shape["head_dim"], shape["n_head"]) if shape and "head_dim" in shape else (64, 2)
    info = hardware.device_info(device)
    backends = hardware.sdpa_backends(device, _DTYPES[precision], head_dim, n_head)
    report: dict[str, Any] = {
        "device": info.to_json(),
        "bf16": hardware.bf16_supported(device),
        "precision": {"name": choice.name, "reason": choice.reason, "warning": choice.warning},
        "sdpa": {"dtype": precision, "head_dim": head_dim, "backends": backends},
        "versions": hardware.versions(),
        "disk": disk_free(Path(cfg.run.output_dir) if cfg else Path.cwd()),
        "extras": installed_extras(),
    }
    if cfg is not None:
        attention = next((name for name in hardware.SDPA_BACKENDS if backends[name] == "ok"), None)
        report["settings"] = settings(cfg, device, precision, attention)
        report["fit"] = fit_estimate(cfg, shape, precision, attention, info.memory_free, world_size)
    return report


def disk_free(where: Path) -> dict[str, Any]:
    """Free bytes on the file system that holds `where` (its nearest existing folder)."""
    path = where.expanduser().resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    return {"path": str(where), "free": shutil.disk_usage(path).free}


def installed_extras() -> dict[str, list[str]]:
    """Each optional extra of kubetrain -> its packages that are missing (empty: installed)."""
    try:
        requirements = metadata.requires("kubetrain") or []
    except metadata.PackageNotFoundError:
        return {}
    extras: dict[str, list[str]] = {}
    for req in requirements:
        extra = re.search(r'extra\s*==\s*"([^"]+)"', req)
        name = re.match(r"[A-Za-z0-9_.-]+", req)
        if extra is None or name is None or extra.group(1) in ("all", "dev"):
            continue  # required packages, and the extras made of other extras
        missing = extras.setdefault(extra.group(1), [])
        try:
            metadata.version(name.group(0))
        except metadata.PackageNotFoundError:
            missing.append(name.group(0))
    return extras


def model_shape(cfg: Config) -> dict[str, Any]:
    """Parameters, layers, width, heads and vocabulary of the config's model, built on the meta device."""
    if cfg.model.kind == "hf":
        return _hf_shape(cfg)
    from kubetrain.models import gpt_config
    from kubetrain.models.gpt import GPT

    vocab = _tokenizer_vocab(cfg)
    if vocab is None and cfg.model.vocab_size is None:
        return {"error": f"the vocabulary of the {cfg.data.tokenizer.kind} tokenizer is known after prepare; "
                         "set model.vocab_size for an estimate"}
    gc = gpt_config(cfg.model, vocab or cfg.model.vocab_size or 0)
    with torch.device("meta"):
        params = sum(p.numel() for p in GPT(gc).parameters())
    return {"params": params, "n_layer": gc.n_layer, "hidden": gc.n_embd, "n_head": gc.n_head,
            "head_dim": gc.head_dim, "vocab": gc.vocab_size, "weight_bytes": 4, "tied": gc.tie_embeddings}


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


def estimate_memory(cfg: Config, shape: dict[str, Any], world_size: int = 1, *, precision: str,
                    attention: str | None) -> dict[str, int]:
    """Peak training memory of one process in bytes, by part: a pure function of the config, the model's shape
    (`model_shape`), the number of processes, the precision and the attention kernel.

    Weights, gradients (fp32) and AdamW's two moments are whole in every process under DDP, which also keeps its
    gradient buckets (a second copy of the gradients); under FSDP they are divided by the world size, plus the
    weights gathered at a time (the root's embedding and head, two blocks: the running one and the prefetched
    one, in the compute dtype, and one block's unsharded gradient). Activations follow Korthikanti et al. 2022
    (34·s·b·h bytes per layer in 16 bit, plus 5·a·s²·b without a fused attention kernel); with gradient
    checkpointing only each block's input is kept, and one block is recomputed at a time. Logits are counted in
    fp32 with their gradient.
    """
    b, s, layers, h, vocab = (cfg.train.micro_batch_size, cfg.model.block_size, shape["n_layer"],
                              shape["hidden"], shape["vocab"])
    params, weight_bytes = shape["params"], shape["weight_bytes"]
    trainable = 0 if cfg.model.lora is not None else params  # LoRA: the adapters are a rounding error
    act = 2 if precision in ("bf16", "fp16") else 4
    per_layer = 34 * s * b * h * act // 2
    if attention not in ("flash", "memory-efficient", "cudnn"):
        per_layer += 5 * shape["n_head"] * s * s * b * act // 2
    checkpointed = cfg.model.gradient_checkpointing
    activations = (layers * s * b * h * act + per_layer) if checkpointed else layers * per_layer
    parts = {"weights": params * weight_bytes, "gradients": trainable * 4, "optimizer": trainable * 8}
    if world_size > 1 and cfg.dist.strategy == "fsdp":
        root = vocab * h * (1 if shape.get("tied", True) else 2)
        block = max(0, params - root) // max(1, layers)
        compute = 2 if precision == "bf16" else weight_bytes
        parts = {k: -(-v // world_size) for k, v in parts.items()}
        parts["gathered"] = (root + 2 * block) * compute + (block * 4 if trainable else 0)
    elif world_size > 1:
        parts["ddp_buckets"] = trainable * 4
    parts |= {"activations": activations, "logits": b * s * vocab * (act + 8)}
    return parts


def fit_estimate(
    cfg: Config, shape: dict[str, Any] | None, precision: str, attention: str | None, free: int | None,
    world_size: int = 1,
) -> dict[str, Any]:
    """Training memory of one process (`estimate_memory`) against `free`, or why it cannot be estimated."""
    if not shape or "error" in shape:
        return {"estimate": None, "reason": (shape or {}).get("error", "unknown model")}
    parts = estimate_memory(cfg, shape, world_size, precision=precision, attention=attention)
    total = sum(parts.values())
    return {"estimate": total, "parts": parts, "params": shape["params"], "free": free, "world_size": world_size,
            "strategy": cfg.dist.strategy if world_size > 1 else "single",
            "fits": None if free is None else total <= free}


def settings(cfg: Config, device: torch.device, precision: str, attention: str | None) -> dict[str, Any]:
    """What a run of `cfg` started here would use."""
    from kubetrain.train.device import peak_flops, torch_settings

    torch_set = torch_settings(cfg, device.type)
    backend = cfg.dist.backend if cfg.dist.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    return {
        "device": str(device), "precision": precision, "attention": attention or "none usable",
        "dist_backend": backend, "strategy": cfg.dist.strategy, "compile": cfg.train.compile,
        "threads": cfg.run.threads or torch.get_num_threads(), "deterministic": torch_set.deterministic,
        "tf32": torch_set.tf32, "peak_flops": peak_flops(device, precision, torch_set.tf32),
        "micro_batch_size": cfg.train.micro_batch_size, "grad_accum_steps": cfg.train.grad_accum_steps,
        "tokens_per_step": cfg.train.micro_batch_size * cfg.train.grad_accum_steps * cfg.model.block_size,
    }


def render(report: dict[str, Any]) -> str:
    """The report for a terminal, one fact per line."""
    d = report["device"]
    count = f"{d['count']} cores" if d["kind"] == "cpu" else f"x{d['count']}"
    lines = [f"device: {d['kind']} - {d['name']} ({count}), memory {_gib(d['memory_free'])} free of "
             f"{_gib(d['memory_total'])}", f"bf16: {'yes' if report['bf16'] else 'no'}"]
    p = report["precision"]
    lines.append(f"precision: {p['name']} ({p['reason']})" + (f" - warning: {p['warning']}" if p["warning"] else ""))
    sdpa = report["sdpa"]
    lines.append(f"attention kernels (SDPA, {sdpa['dtype']}, head size {sdpa['head_dim']}):")
    lines += [f"  {name}: {why}" for name, why in sdpa["backends"].items()]
    v = report["versions"]
    lines.append("versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val) +
                 ("" if v["nccl"] else ", nccl not available"))
    lines.append(f"disk: {_gib(report['disk']['free'])} free at {report['disk']['path']}")
    lines.append("extras: " + ", ".join(f"{name} {'yes' if not missing else 'no (' + ', '.join(missing) + ')'}"
                                        for name, missing in report["extras"].items()))
    if "settings" in report:
        lines.append("a run here would use: " + ", ".join(f"{k} {json.dumps(val)}"
                                                          for k, val in report["settings"].items()))
        lines.append(_fit_line(report["fit"]))
    return "\n".join(lines)


def _fit_line(fit: dict[str, Any]) -> str:
    if fit["estimate"] is None:
        return f"memory: not estimated ({fit['reason']})"
    parts = ", ".join(f"{k} {_gib(v)}" for k, v in fit["parts"].items())
    verdict = "unknown free memory" if fit["fits"] is None else "fits" if fit["fits"] else "does NOT fit"
    per = f"each of {fit['world_size']} processes ({fit['strategy']})" if fit["world_size"] > 1 else "one process"
    return (f"memory (an estimate): {_gib(fit['estimate'])} in {per} for {fit['params']:,} parameters and one "
            f"micro-batch ({parts}) - {verdict} in {_gib(fit['free'])} free")


def _gib(n: int | None) -> str:
    return "unknown" if n is None else f"{n / 2**30:.2f} GiB"

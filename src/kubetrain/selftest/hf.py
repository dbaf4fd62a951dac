"""Hugging Face: LoRA on a tiny local Llama in bf16, sampling with the KV cache, export to HF and GGUF."""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubetrain.selftest import Outcome, judged, skipped
from kubetrain.selftest.context import Context, config, losses, train

NEW_TOKENS = 8
LOGIT_TOLERANCE = 1e-3  # the exported fp32 model against the trained one, on the same prompt


def _missing(*modules: str) -> str | None:
    absent = [m for m in modules if importlib.util.find_spec(m) is None]
    return f"{', '.join(absent)} not installed (pip install 'kubetrain[hf]')" if absent else None


_state: dict[str, Any] = {}


def lora_bf16(ctx: Context) -> Outcome:
    name = "hf.lora_bf16"
    missing = _missing("transformers", "peft")
    if missing:
        return skipped(name, missing)
    from kubetrain.selftest.tiny_llama import build, corpus

    llama = build(ctx.work / "llama")
    text = ctx.work / "corpus.txt"
    text.write_text(corpus())
    steps = 10 if ctx.quick else 40
    precision = "bf16"
    cfg = config(ctx, "hf-lora", "model.kind=hf", f"model.name_or_path={llama}", "model.block_size=32",
                 "model.lora.r=8", "model.lora.alpha=16", f"data.sources=[{{kind: text, path: {text}}}]",
                 f"train.precision={precision}", f"train.max_steps={steps}", "train.lr=1e-2", "train.grad_clip=1.0")
    result, rows = train(cfg)
    curve = losses(rows)
    _state["run"] = Path(result.run_dir)
    learned = all(math.isfinite(x) for x in curve) and curve[-1] < curve[0]
    return judged(name, learned, f"LoRA (r 8) on a 2-layer Llama built here from a config, {steps} steps in "
                  f"{precision} on {ctx.device}, the frozen base loaded in bf16",
                  {"first_loss": curve[0], "final_loss": curve[-1], "steps": len(curve)},
                  "finite losses, the last below the first")


def generate(ctx: Context) -> Outcome:
    """Greedy tokens with the KV cache (kubetrain's sampler) against a full forward for every new token."""
    name = "hf.generate"
    if "run" not in _state:
        return skipped(name, "no LoRA run to sample (hf.lora_bf16 did not train one)")
    import torch

    from kubetrain.data.tokenizers import prompt_ids
    from kubetrain.models.load import load_trained
    from kubetrain.models.sampling import generate as sample
    from kubetrain.train.device import autocast

    model, tokenizer, cfg, _ = load_trained(_state["run"], "latest")
    device = torch.device(ctx.device)
    # fp32 without TF32 (the trainer turned it on in this process): two paths to the same argmax, no near-ties
    model = model.float().to(device)
    torch.backends.cuda.matmul.allow_tf32 = False
    ids = prompt_ids(tokenizer, "red green blue")
    cached = sample(model, ids, NEW_TOKENS, cfg.model.block_size, temperature=0, top_k=None, seed=0)
    full = list(ids)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(torch.tensor([full], device=device))
            full.append(int(logits[0, -1].float().argmax()))
    in_bf16 = sample(model, ids, NEW_TOKENS, cfg.model.block_size, temperature=0, top_k=None, seed=0,
                     autocast_ctx=autocast("bf16", device))
    text = tokenizer.decode(cached)
    _state["generated"] = cached
    return judged(name, cached == full[len(ids):] and len(in_bf16) == NEW_TOKENS,
                  f"{NEW_TOKENS} greedy tokens of the trained LoRA model with the KV cache, against a full forward "
                  "per token; and the same in bf16 autocast", {"text": text, "tokens": cached, "bf16_tokens": in_bf16},
                  "identical greedy tokens (fp32); bf16 sampling runs")


def export_hf(ctx: Context) -> Outcome:
    name = "hf.export_hf"
    if "run" not in _state:
        return skipped(name, "no LoRA run to export (hf.lora_bf16 did not train one)")
    import torch
    from transformers import AutoModelForCausalLM

    from kubetrain.export import export
    from kubetrain.models.load import load_trained
    from kubetrain.models.lora import merge_lora

    out = ctx.work / "export-hf"
    done = export(_state["run"], "hf", out, merge=True, which="latest", dtype="float32")
    exported = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    model = merge_lora(load_trained(_state["run"], "latest")[0]).float()
    ids = torch.tensor([[0, 5, 9, 14, 20, 31]])
    with torch.no_grad():
        diff = float((exported(ids).logits - model(ids)).abs().max())
    files = sorted(p.name for p in out.iterdir())
    return judged(name, diff <= LOGIT_TOLERANCE,
                  "merged LoRA exported as a Hugging Face folder (float32), loaded by transformers on its own",
                  {"max_abs_logit_diff": diff, "files": files, "kind": done.kind},
                  f"max |logit difference| against kubetrain's merged model <= {LOGIT_TOLERANCE}")


def export_gguf(ctx: Context) -> Outcome:
    name = "hf.export_gguf"
    if importlib.util.find_spec("gguf") is None:
        return skipped(name, "gguf is not installed (pip install 'kubetrain[export]')")
    if "run" not in _state:
        return skipped(name, "no LoRA run to export (hf.lora_bf16 did not train one)")
    from gguf import GGUFReader

    from kubetrain.export import export

    out = ctx.work / "model.gguf"
    export(_state["run"], "gguf", out, merge=True, which="latest", dtype="float32")
    reader = GGUFReader(str(out))
    arch = reader.fields["general.architecture"].contents()
    blocks = reader.fields["llama.block_count"].contents()
    tensors = len(reader.tensors)
    # 2 blocks x 9 tensors + token embedding, final norm and output head
    return judged(name, arch == "llama" and blocks == 2 and tensors == 21,
                  "merged LoRA exported to GGUF (float32) and read back with gguf's reader",
                  {"bytes": out.stat().st_size, "architecture": arch, "block_count": blocks, "tensors": tensors},
                  "architecture llama, 2 blocks, 21 tensors")


CHECKS: dict[str, Callable[[Context], Outcome]] = {
    "hf.lora_bf16": lora_bf16, "hf.generate": generate, "hf.export_hf": export_hf, "hf.export_gguf": export_gguf,
}

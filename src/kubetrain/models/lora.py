"""LoRA adapters through PEFT, for our GPT and for Hugging Face models alike.

The base weights are frozen, so the loop's checkpoints hold only the adapters (and modules_to_save) and
their optimizer state. Our GPT names its linears like Llama (q_proj ... down_proj), so one list of
target modules fits both.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kubetrain.config.schema import LoraConfig
from kubetrain.errors import ConfigError
from kubetrain.models.hf import HFCausalLM


def peft_config(cfg: LoraConfig, causal_lm: bool) -> Any:
    """The PEFT LoraConfig for our config section; causal_lm gives PEFT's causal-LM wrapper (HF models)."""
    try:
        from peft import LoraConfig as PeftLoraConfig
    except ImportError:
        raise ConfigError("model.lora needs peft: pip install 'kubetrain[hf]'") from None
    return PeftLoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=cfg.target_modules,
        modules_to_save=cfg.modules_to_save,
        bias="none",
        task_type="CAUSAL_LM" if causal_lm else None,
    )


def apply_lora(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """Freeze the model and add LoRA adapters; forward(input_ids) -> logits and `.blocks` keep working.

    For an HF model the adapters go on the transformers model inside, so PEFT can save them in its own
    format (adapter_config.json + adapter_model.safetensors) for `kubetrain export` without --merge.
    """
    from peft import get_peft_model

    try:
        with warnings.catch_warnings():
            # peft reads transformers' deprecated is_gradient_checkpointing; nothing for the user to act on
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            if isinstance(model, HFCausalLM):
                if getattr(model.lm, "is_loaded_in_4bit", False):  # QLoRA: PEFT's preparation of a k-bit base
                    from peft import prepare_model_for_kbit_training

                    # norms and embeddings to fp32, every base weight frozen; checkpointing stays as loaded
                    model.lm = prepare_model_for_kbit_training(model.lm, use_gradient_checkpointing=False)
                model.lm = get_peft_model(model.lm, peft_config(cfg, causal_lm=True))
                return model
            return get_peft_model(model, peft_config(cfg, causal_lm=False))
    except ValueError as e:
        first = str(e).strip().splitlines()[0]
        raise ConfigError(f"model.lora: {first}") from None


def init_adapters(model: nn.Module, init: Callable[[str, torch.Tensor, str, float], None]) -> None:
    """PEFT's default init of the adapters of a model built on meta: A from kaiming_uniform(a=sqrt(5)), i.e.
    uniform within 1/sqrt(fan_in), B zero, so the adapted model starts as its base (embeddings: A zero, B normal)."""
    for name, p in model.named_parameters():
        if ".lora_A." in name:
            init(name, p, "uniform", 1 / math.sqrt(p.shape[1]))
        elif ".lora_B." in name or ".lora_embedding_A." in name:
            init(name, p, "constant", 0.0)
        elif ".lora_embedding_B." in name:
            init(name, p, "normal", 1.0)


def is_lora(model: nn.Module) -> bool:
    """True for a model that carries LoRA adapters (from apply_lora)."""
    if "peft" not in sys.modules:  # nothing can carry adapters if PEFT was never imported (or is not installed)
        return False
    from peft import PeftModel

    inner = model.lm if isinstance(model, HFCausalLM) else model
    return isinstance(inner, PeftModel)


def merge_lora(model: nn.Module) -> nn.Module:
    """The plain model (our GPT or HFCausalLM) with every adapter folded into its base weights."""
    if not is_lora(model):
        return model
    if isinstance(model, HFCausalLM):
        model.lm = model.lm.merge_and_unload()
        return model
    merged: nn.Module = model.merge_and_unload()  # type: ignore[operator]
    return merged


def adapted_head(head: nn.Module, hidden: torch.Tensor
                 ) -> tuple[nn.Linear, tuple[torch.Tensor, torch.Tensor] | None] | None:
    """A head carrying PEFT's LoRA as the fused head + loss takes it: its base linear and the adapters' term (u, B),
    so that `head(hidden) == base(hidden) + u @ B.T`, with u = scaling * A(dropout(hidden)) and B the adapters' B
    (several active adapters side by side); (base, None) where no adapter applies (merged, or none active). None
    for anything else (DoRA and other variants, a bias on B, modules_to_save, a layer that is not PEFT's LoRA on a
    linear): the caller computes the head's whole logits, whose autograd reaches every parameter. Handing the
    fused loss the base weight alone would give the adapters no gradient, and DDP would then fail its next step
    waiting for theirs."""
    if "peft" not in sys.modules:
        return None
    from peft.tuners.lora.layer import Linear as LoraLinear

    if type(head) is not LoraLinear or type(head.base_layer) is not nn.Linear or head.disable_adapters:
        return None
    base = head.base_layer
    if head.merged:  # the adapters are in the base weight, and PEFT's forward runs the base alone
        return base, None
    active = [name for name in head.active_adapters if name in head.lora_A]
    if any(name in getattr(head, "lora_variant", {}) or head.use_dora.get(name) or head.lora_B[name].bias is not None
           for name in active):
        return None
    if not active:
        return base, None
    ins: list[torch.Tensor] = []
    outs: list[torch.Tensor] = []
    for name in active:
        a, b = head.lora_A[name], head.lora_B[name]
        assert isinstance(a, nn.Linear) and isinstance(b, nn.Linear)  # PEFT's LoRA on a linear: linears
        x = head._cast_input_dtype(hidden, a.weight.dtype) if hasattr(head, "_cast_input_dtype") else hidden
        ins.append(a(head.lora_dropout[name](x)) * head.scaling[name])
        outs.append(b.weight)
    if len(active) == 1:
        return base, (ins[0], outs[0])
    return base, (torch.cat(ins, dim=-1), torch.cat(outs, dim=1))

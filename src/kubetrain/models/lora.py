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

"""Hugging Face causal LMs behind our model interface: forward(input_ids) -> logits, and `.blocks` for FSDP.

A packed window passes `position_ids` that restart at 0 at each sequence: the rotary positions restart, and
transformers' masking_utils (`find_packed_sequence_indices`) builds its sdpa, eager and flex masks so that each
sequence attends only to itself (flash attention takes them as variable-length sequences); for sdpa and eager,
where that is safe, kubetrain hands one additive mask of its own to every layer instead (`HFCausalLM._packed`). A
model whose attention would not (remote code, another kernel, a transformers without that function) is refused for
packed data.

The model comes from a local folder (offline by default) or a hub id when the config allows it; the token
for gated models is read from the environment or from a mounted Secret file, and is never logged.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kubetrain.config.schema import ModelConfig
from kubetrain.errors import ConfigError, UserInputError
from kubetrain.models.documents import additive_mask, block_causal_mask
from kubetrain.models.loss import linear_loss_sum, lm_loss_sum
from kubetrain.secrets import redact_text

# Trainable weights stay fp32 under "auto": AdamW updates vanish in bf16 weights; autocast gives bf16 compute.
_DTYPES = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16}


def hub_token() -> str | None:
    """HF_TOKEN from the environment, else the file HF_TOKEN_PATH names (a Secret mounted as a file)."""
    token = os.environ.get("HF_TOKEN", "").strip()
    if token:
        return token
    path = os.environ.get("HF_TOKEN_PATH")
    if path and Path(path).is_file():
        return Path(path).read_text().strip() or None
    return None


class HFCausalLM(nn.Module):
    """A transformers causal LM whose forward returns plain logits, like our GPT.

    `lm` is the transformers model (or the PEFT model around it once LoRA is applied).
    """

    lm: Any  # a transformers PreTrainedModel or PeftModel: typed loosely, their attributes are dynamic

    def __init__(self, lm: nn.Module, block_size: int) -> None:
        super().__init__()
        self.lm = lm
        self.block_size = block_size

    @property
    def hf_config(self) -> Any:
        return self.lm.config

    @property
    def blocks(self) -> nn.ModuleList:
        """The decoder layers, so FSDP can shard layer by layer."""
        layers = getattr(self.lm.get_decoder(), "layers", None)
        return layers if isinstance(layers, nn.ModuleList) else nn.ModuleList()

    def forward(self, input_ids: torch.Tensor, kv_cache: Any = None, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, vocab) for token ids (B, T), which follow the tokens in `kv_cache` when one is given; with
        `labels` (B, T) instead the summed cross-entropy of those logits (fp32), made with the head chunk by chunk
        where the head is a plain linear (models/loss.py `linear_loss_sum`). `position_ids` (B, T), restarting at 0
        where a sequence starts, make a packed window (see the module's docstring)."""
        packed = self._packed(position_ids)
        if labels is not None:
            return self._loss_sum(input_ids, labels, packed)
        if kv_cache is None:
            logits: torch.Tensor = self.lm(input_ids=input_ids, use_cache=False, **packed).logits
            return logits
        cached: torch.Tensor = self.lm(input_ids=input_ids, past_key_values=kv_cache, use_cache=True).logits
        return cached

    def _packed(self, position_ids: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """What a packed window hands the transformers model: its `position_ids`, and, where transformers would
        build a boolean mask that SDPA's CPU kernel turns into a float one in every layer (each backward keeping its
        copy: +15% of a small Llama's step, measured), one additive mask for every layer, which transformers passes
        on as it is (a 4D `attention_mask`, masking_utils `_preprocess_mask_arguments`)."""
        if position_ids is None:
            return {}
        dtype = self._shared_mask_dtype(position_ids.device)
        if dtype is None:
            return {"position_ids": position_ids}
        return {"position_ids": position_ids, "attention_mask": additive_mask(block_causal_mask(position_ids), dtype)}

    def _shared_mask_dtype(self, device: torch.device) -> torch.dtype | None:
        """The dtype the attention computes in where one additive mask may replace transformers' own, else None:
        sdpa and eager only (flash and flex take the sequences their own way), never under autocast (the compute
        dtype is not the weights'), never a model with sliding-window layers (its own masks hold the window)."""
        base = self.lm.get_base_model() if hasattr(self.lm, "get_base_model") else self.lm
        config = base.config
        if getattr(config, "_attn_implementation", None) not in ("sdpa", "eager"):
            return None
        if torch.is_autocast_enabled(device.type):
            return None
        kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
        if getattr(config, "sliding_window", None) or getattr(config, "attention_chunk_size", None) \
                or kinds != {"full_attention"}:
            return None
        dtype: torch.dtype = base.get_input_embeddings().weight.dtype
        return dtype

    def _loss_sum(self, input_ids: torch.Tensor, labels: torch.Tensor, packed: dict[str, torch.Tensor]
                  ) -> torch.Tensor:
        """The transformers model's decoder (under LoRA: the base model's, its layers adapted in place), then the
        head and loss together. A head that is more than a linear (LoRA or modules_to_save on it, a quantized head,
        logits changed after it: Gemma's soft-capping, Cohere's scale, Granite's scaling; remote code, which nobody
        here has read) gets the whole logits and the chunked loss."""
        base = self.lm.get_base_model() if hasattr(self.lm, "get_base_model") else self.lm
        head = base.get_output_embeddings()
        config = base.config
        plain = (type(head) is nn.Linear and type(base).__module__.startswith("transformers.")
                 and base.base_model is not base and getattr(config, "final_logit_softcapping", None) is None
                 and all(getattr(config, name, None) in (None, 1.0) for name in ("logit_scale", "logits_scaling")))
        if not plain:
            return lm_loss_sum(self(input_ids, **packed), labels)
        hidden = base.base_model(input_ids=input_ids, use_cache=False, **packed).last_hidden_state
        return linear_loss_sum(hidden, head.weight, head.bias, labels)

    def packed_attention_problem(self) -> str | None:
        """Why this model would attend across the sequences of a packed window (one line), or None where it keeps
        them apart: its modeling code builds its mask with transformers' masking_utils, which reads packed
        `position_ids` (sdpa, eager, flex) or hands them to flash attention's variable-length kernel."""
        masking_utils: Any = None
        with contextlib.suppress(ImportError):
            from transformers import masking_utils
        base = self.lm.get_base_model() if hasattr(self.lm, "get_base_model") else self.lm
        kind = getattr(base.config, "_attn_implementation", None) or "eager"
        modeling = sys.modules.get(type(base).__module__)
        masks = [getattr(masking_utils, n, None) for n in ("create_causal_mask", "create_sliding_window_causal_mask")]
        uses_masking_utils = modeling is not None and any(
            m is not None and getattr(modeling, n, None) is m
            for n, m in zip(("create_causal_mask", "create_sliding_window_causal_mask"), masks, strict=True))
        if masking_utils is None or not hasattr(masking_utils, "find_packed_sequence_indices"):
            return "this transformers builds no mask from packed position_ids: upgrade it (pip install -U transformers)"
        if not uses_masking_utils:
            return (f"{type(base).__name__} ({type(base).__module__}) builds its attention mask without transformers' "
                    "masking_utils, so packed sequences would attend to each other")
        if kind not in ("sdpa", "eager", "flex_attention") and not kind.startswith("flash_attention"):
            return f"its attention implementation '{kind}' gets no mask for packed sequences (sdpa and eager do)"
        return None

    def new_kv_cache(self) -> Any:
        """An empty transformers cache for `forward(ids, kv_cache=...)` (sampling)."""
        from transformers import DynamicCache

        return DynamicCache(config=self.hf_config)

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 x the matmul weights (not the embedding lookup) + attention."""
        c = self.hf_config
        embed = self.lm.get_input_embeddings().weight
        n = sum(p.numel() for p in self.parameters()) - embed.numel()
        if getattr(c, "tie_word_embeddings", False):
            n += embed.numel()  # the tied lm_head is a matmul
        return 6.0 * n + 12.0 * c.num_hidden_layers * c.hidden_size * self.block_size


def nf4_quantization(cfg: ModelConfig) -> dict[str, Any]:
    """The BitsAndBytesConfig arguments of QLoRA (model.quantize: nf4), as PEFT's and litgpt's recipes have them.

    NF4 weights with double quantization (the quantization constants quantized too); matmuls in the weight
    dtype the loop chose (model.dtype, bf16 on a GPU that has it).
    """
    return {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
            "bnb_4bit_compute_dtype": _DTYPES[cfg.dtype]}


def load_hf_model(cfg: ModelConfig, tokenizer_vocab: int | None = None,
                  device: torch.device | None = None) -> HFCausalLM:
    """AutoModelForCausalLM from cfg.name_or_path, ready for training on the CPU (the loop moves it).

    A 4-bit model (model.quantize: nf4) is quantized while it loads, straight onto `device`.
    """
    try:
        import transformers
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise ConfigError("model.kind 'hf' needs transformers: pip install 'kubetrain[hf]'") from None
    assert cfg.name_or_path is not None
    local = Path(cfg.name_or_path).expanduser()
    offline = cfg.local_files_only or os.environ.get("HF_HUB_OFFLINE") == "1"
    if offline and not local.exists():
        raise UserInputError(
            f"model folder not found: {cfg.name_or_path} (model.local_files_only: nothing is downloaded)"
        )
    transformers.utils.logging.disable_progress_bar()
    quantized: dict[str, Any] = {}
    if cfg.quantize == "nf4":
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            raise ConfigError("model.quantize nf4 needs bitsandbytes: pip install 'kubetrain[qlora]'") from None
        quantized = {"quantization_config": transformers.BitsAndBytesConfig(**nf4_quantization(cfg)),
                     "device_map": {"": str(device or "cpu")}}
    try:
        lm: Any = AutoModelForCausalLM.from_pretrained(
            str(local) if local.exists() else cfg.name_or_path,
            revision=cfg.revision,
            local_files_only=offline,
            trust_remote_code=cfg.trust_remote_code,
            token=hub_token(),
            dtype=_DTYPES[cfg.dtype],
            **quantized,
        )
    except (OSError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserInputError(f"model '{cfg.name_or_path}' did not load: {redact_text(first)}") from None
    return _ready(lm, cfg, tokenizer_vocab)


def _ready(lm: Any, cfg: ModelConfig, tokenizer_vocab: int | None) -> HFCausalLM:
    """Checks against the config and tokenizer, gradient checkpointing, training mode: for loaded and built models."""
    lm.config.use_cache = False
    n_pos = getattr(lm.config, "max_position_embeddings", None)
    if n_pos is not None and cfg.block_size > n_pos:
        raise ConfigError(f"model.block_size ({cfg.block_size}) exceeds the model's {n_pos} positions")
    rows = int(lm.get_input_embeddings().num_embeddings)
    if tokenizer_vocab is not None and tokenizer_vocab > rows:
        raise ConfigError(
            f"the tokenizer has {tokenizer_vocab} tokens but {cfg.name_or_path} embeds only {rows}; "
            "use the model's own tokenizer (data.tokenizer.kind: hf)"
        )
    if cfg.gradient_checkpointing:
        # Non-reentrant checkpointing also works when the inputs of a layer need no grad (a frozen LoRA base).
        kwargs = {"use_reentrant": False}
        if hasattr(lm, "activation_checkpointing_enable"):  # transformers 5 renamed it
            lm.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    lm.train()
    return HFCausalLM(lm, cfg.block_size)


def safetensors_files(cfg: ModelConfig) -> list[Path]:
    """The weight files of a local model folder (the index's shards, or the single file); [] if it has none."""
    folder = Path(cfg.name_or_path or "").expanduser()
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / name for name in shards]
    single = folder / "model.safetensors"
    return [single] if single.is_file() else []


def build_hf_model(cfg: ModelConfig, tokenizer_vocab: int | None = None) -> HFCausalLM:
    """The model of a local folder built from its config.json in the configured dtype, weights not loaded:
    built with meta parameters, sharded, then `load_hf_weights` reads each process's part of the files."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = str(Path(cfg.name_or_path or "").expanduser())
    try:
        hf_config = AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserInputError(f"model '{cfg.name_or_path}' did not load: {redact_text(first)}") from None
    lm = AutoModelForCausalLM.from_config(hf_config, dtype=_DTYPES[cfg.dtype], trust_remote_code=cfg.trust_remote_code)
    return _ready(lm, cfg, tokenizer_vocab)


def plain_name(name: str) -> str:
    """A weight's name without PEFT's wrapper (`q_proj.base_layer.weight` is `q_proj.weight`)."""
    return name.replace(".base_layer.", ".")


def load_hf_weights(model: HFCausalLM, cfg: ModelConfig) -> None:
    """Each process reads its shard of every weight from the folder's safetensors files, cast to the model's dtype.

    Under LoRA the base layers are found under their plain names; the adapters are not in the files."""
    from kubetrain.distributed.parallelize import load_safetensors_into

    base = getattr(model.lm, "get_base_model", None)  # a PeftModel (models/lora.py) wraps the base model
    lm = base() if callable(base) else model.lm
    targets = {**dict(lm.named_buffers()), **dict(lm.named_parameters(remove_duplicate=False))}
    targets = {plain_name(name): t for name, t in targets.items() if ".lora_" not in name}
    found = load_safetensors_into(targets, safetensors_files(cfg))
    missing = sorted({plain_name(name) for name, _ in lm.named_parameters() if ".lora_" not in name} - found)
    if missing:
        raise UserInputError(f"model '{cfg.name_or_path}': its files hold no weight {missing[0]} "
                             f"({len(missing)} missing)")

"""QLoRA (model.quantize: nf4): what runs without bitsandbytes is tested always; the 4-bit load and a training
step run for real where bitsandbytes is installed (`pip install 'kubetrain[qlora]'`; it runs on the CPU)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kubetrain.config import load_config
from kubetrain.config.schema import ModelConfig
from kubetrain.errors import ConfigError
from kubetrain.models.hf import load_hf_model, nf4_quantization

HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None


@pytest.mark.parametrize("overrides, message", [
    (["model.quantize=nf4"], "needs a Hugging Face model"),
    (["model.kind=hf", "model.name_or_path=/m", "model.quantize=nf4"], "needs a Hugging Face model"),
    (["model.kind=hf", "model.name_or_path=/m", "model.lora.r=8", "model.quantize=nf4", "dist.strategy=fsdp"],
     "dist.strategy ddp"),
])
def test_qlora_needs_an_hf_model_with_lora_outside_fsdp(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides)


def test_the_nf4_recipe() -> None:
    cfg = ModelConfig(kind="hf", name_or_path="/m", quantize="nf4", dtype="bfloat16",
                      lora={"r": 8})  # type: ignore[arg-type]
    assert nf4_quantization(cfg) == {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                                     "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": torch.bfloat16}


def test_without_bitsandbytes_it_is_one_line(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # what `import bitsandbytes` meets where it is absent
    cfg = ModelConfig(kind="hf", name_or_path=str(llama_dir), quantize="nf4", lora={"r": 8})  # type: ignore[arg-type]
    needs = r"^model\.quantize nf4 needs bitsandbytes: pip install 'kubetrain\[qlora\]'$"
    with pytest.raises(ConfigError, match=needs):
        load_hf_model(cfg)


@pytest.mark.skipif(not HAS_BNB, reason="bitsandbytes is not installed (pip install 'kubetrain[qlora]')")
def test_a_4bit_base_trains_only_its_adapters(make_lora_config: Any, hf_tokenizer_dir: Path, chat_file: Path,
                                               tmp_path: Path) -> None:
    import shutil

    from kubetrain.train.trainer import RunOptions, Trainer
    from tests.hf_models import build_llama

    # hidden 64: bitsandbytes' CPU inference packing needs rows of at least one 64-value quantization block
    llama = tmp_path / "llama64"
    shutil.copytree(hf_tokenizer_dir, llama)
    build_llama(llama, vocab=352, hidden=64)
    cfg = make_lora_config(tmp_path, llama, chat_file, train__max_steps=3, eval__every_steps=3,
                           checkpoint__every_steps=3)
    cfg.model.quantize = "nf4"
    trainer = Trainer(cfg, RunOptions(argv=[]), log=lambda m: None)
    result = trainer.run()
    lm = trainer.base.lm  # type: ignore[union-attr]
    assert lm.is_loaded_in_4bit
    packed = [p for p in trainer.base.parameters() if p.__class__.__name__ == "Params4bit"]
    assert packed and all(p.dtype == torch.uint8 and not p.requires_grad for p in packed)
    assert all(p.dtype == torch.float32 for p in trainer.base.parameters() if p.requires_grad)
    assert result.status == "finished" and result.final_train_loss is not None
    assert (tmp_path / "lora" / "checkpoints" / "step-000003").is_dir()

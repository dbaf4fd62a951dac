"""Hugging Face export: our GPT loads as a Llama with the same logits; LoRA runs merged or as adapters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from kubetrain.data.tokenizers import ByteTokenizer, Tokenizer, train_bpe
from kubetrain.export import export
from kubetrain.export.hf import save_gpt
from kubetrain.models.gpt import GPT, GPTConfig
from kubetrain.models.load import load_trained

TEXT = "The quick brown fox — jumps over the lazy dog.\n\tÜber naïve café 123!"


def gpt(tie: bool, vocab: int = 256) -> GPT:
    torch.manual_seed(1)
    model = GPT(GPTConfig(vocab_size=vocab, block_size=32, n_layer=2, n_head=4, n_embd=32, tie_embeddings=tie,
                          rope_theta=500000.0, norm_eps=1e-6))
    with torch.no_grad():  # norms away from 1 so a misplaced norm weight shows in the logits
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return model.eval()


def assert_same_logits(ours: torch.nn.Module, folder: Path, vocab: int) -> None:
    theirs = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    ids = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(input_ids=ids).logits, ours(ids), rtol=1e-5, atol=1e-5)


def assert_same_tokens(ours: Tokenizer, folder: Path) -> None:
    theirs = AutoTokenizer.from_pretrained(str(folder))
    ids = ours.encode(TEXT)
    assert theirs.encode(TEXT, add_special_tokens=False) == ids
    assert theirs.decode(ids) == TEXT


@pytest.mark.parametrize("tie", [True, False])
def test_our_gpt_loads_in_transformers_with_the_same_logits(tmp_path: Path, tie: bool) -> None:
    model = gpt(tie)
    save_gpt(model, ByteTokenizer(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is tie
    assert config["rope_theta"] == 500000.0
    assert_same_logits(model, tmp_path, 256)
    assert_same_tokens(ByteTokenizer(), tmp_path)


def test_our_gpt_folder_has_the_generation_config_transformers_generates_with(tmp_path: Path) -> None:
    from transformers import GenerationConfig

    save_gpt(gpt(True), ByteTokenizer(), tmp_path)
    assert (tmp_path / "generation_config.json").is_file()
    gen = GenerationConfig.from_pretrained(str(tmp_path))
    assert (gen.bos_token_id, gen.eos_token_id) == (ByteTokenizer.bos_id, ByteTokenizer.eos_id)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert (tok.bos_token_id, tok.eos_token_id) == (gen.bos_token_id, gen.eos_token_id)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert model.generation_config.eos_token_id == ByteTokenizer.eos_id  # what generate() stops on


def test_a_bpe_run_exports_its_tokenizer_and_float16_weights(tmp_path: Path) -> None:
    bpe = train_bpe([TEXT * 3, "the fox and the dog"], vocab_size=300)
    save_gpt(gpt(True, vocab=320), bpe, tmp_path, dtype="float16")
    assert_same_tokens(bpe, tmp_path)
    assert AutoTokenizer.from_pretrained(str(tmp_path)).eos_token_id == bpe.eos_id
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F16"}  # noqa: SIM118
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "float16"


def test_a_merged_lora_run_matches_the_adapter_model(lora_run: Path, tmp_path: Path) -> None:
    done = export(lora_run, "hf", tmp_path / "merged", merge=True)
    assert done.kind == "merged" and done.step == 24
    adapted, tok, _, _ = load_trained(lora_run)
    with safe_open(str(tmp_path / "merged" / "model.safetensors"), "pt") as f:
        assert not any("lora" in k for k in f.keys())  # noqa: SIM118
    assert_same_logits(adapted, tmp_path / "merged", tok.vocab_size)


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")  # inside peft
def test_an_adapter_alone_loads_with_peft(lora_run: Path, llama_dir: Path, tmp_path: Path) -> None:
    from peft import PeftModel

    assert export(lora_run, "hf", tmp_path / "adapter").kind == "adapter"
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    base = AutoModelForCausalLM.from_pretrained(str(llama_dir))
    peft = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    adapted, _, _, _ = load_trained(lora_run)
    ids = torch.randint(0, 330, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(peft(input_ids=ids).logits, adapted(ids))


def test_a_merged_gpt_lora_run_unties_its_trained_head(gpt_lora_run: Path, tmp_path: Path) -> None:
    export(gpt_lora_run, "hf", tmp_path / "out", merge=True)
    adapted, tok, _, _ = load_trained(gpt_lora_run)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"] is False
    assert_same_logits(adapted, tmp_path / "out", tok.vocab_size)
    assert_same_tokens(tok, tmp_path / "out")


def test_a_full_finetune_exports_as_itself(hf_full_run: Path, tmp_path: Path) -> None:
    done = export(hf_full_run, "hf", tmp_path / "out")
    assert done.kind == "model"
    trained, tok, _, _ = load_trained(hf_full_run)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "float32"  # as the base
    assert_same_logits(trained, tmp_path / "out", tok.vocab_size)
    assert_same_tokens(tok, tmp_path / "out")

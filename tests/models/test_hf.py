"""Hugging Face causal LMs behind our model interface: logits, layers, dtype, checkpointing, errors, runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kubetrain.cli import main
from kubetrain.config.loading import validate
from kubetrain.config.schema import ModelConfig
from kubetrain.errors import ConfigError, UserInputError
from kubetrain.models import build_model
from kubetrain.models.hf import HFCausalLM, hub_token, load_hf_model
from kubetrain.models.load import load_trained
from kubetrain.models.loss import lm_loss


def hf_model(path: Path, **kw: object) -> ModelConfig:
    return ModelConfig(kind="hf", name_or_path=str(path), block_size=kw.pop("block_size", 64), **kw)  # type: ignore[arg-type]


def test_forward_returns_the_models_logits(llama_dir: Path) -> None:
    model = build_model(hf_model(llama_dir), tokenizer_vocab=330)
    reference = AutoModelForCausalLM.from_pretrained(str(llama_dir))
    ids = torch.randint(0, 330, (2, 16))
    assert isinstance(model, HFCausalLM)
    assert torch.equal(model(ids), reference(input_ids=ids).logits)
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == 2
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_dtype_and_gradient_checkpointing(llama_dir: Path) -> None:
    assert next(load_hf_model(hf_model(llama_dir, dtype="bfloat16")).parameters()).dtype == torch.bfloat16
    ids = torch.randint(0, 330, (2, 16))
    grads = []
    for ckpt in (False, True):
        model = load_hf_model(hf_model(llama_dir, gradient_checkpointing=ckpt))
        assert model.lm.is_activation_checkpointing is ckpt
        lm_loss(model(ids[:, :-1]), ids[:, 1:].contiguous()).backward()
        grads.append(model.lm.model.layers[0].mlp.up_proj.weight.grad)
    torch.testing.assert_close(grads[0], grads[1])


def test_bad_model_settings_are_one_line_errors(llama_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(UserInputError, match=r"model folder not found: .*nowhere \(model.local_files_only"):
        load_hf_model(hf_model(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserInputError, match=r"model '.*empty' did not load"):
        load_hf_model(hf_model(tmp_path / "empty"))
    with pytest.raises(ConfigError, match=r"block_size \(256\) exceeds the model's 128 positions"):
        load_hf_model(hf_model(llama_dir, block_size=256))
    with pytest.raises(ConfigError, match=r"the tokenizer has 1000 tokens but .* embeds only 352"):
        load_hf_model(hf_model(llama_dir), tokenizer_vocab=1000)


def test_token_from_the_environment_or_a_mounted_secret(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_TOKEN_PATH", raising=False)
    assert hub_token() is None
    secret = tmp_path / "token"
    secret.write_text("hf_fromthesecretfile0000\n")
    monkeypatch.setenv("HF_TOKEN_PATH", str(secret))
    assert hub_token() == "hf_fromthesecretfile0000"
    monkeypatch.setenv("HF_TOKEN", "hf_fromtheenvironment000")
    assert hub_token() == "hf_fromtheenvironment000"


def test_an_hf_model_reads_with_its_own_tokenizer_unless_told(llama_dir: Path) -> None:
    cfg = validate({"model": {"kind": "hf", "name_or_path": str(llama_dir)}})
    assert (cfg.data.tokenizer.kind, cfg.data.tokenizer.path) == ("hf", str(llama_dir))
    cfg = validate({"model": {"kind": "hf", "name_or_path": str(llama_dir)},
                    "data": {"tokenizer": {"kind": "byte"}}})
    assert cfg.data.tokenizer.kind == "byte"


def test_full_finetune_saves_every_weight_and_generates(
    hf_full_run: Path, llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, tok, _, ckpt = load_trained(hf_full_run)
    assert "lm.model.embed_tokens.weight" in ckpt.model_state()  # a full fine-tune saves every weight
    base = AutoModelForCausalLM.from_pretrained(str(llama_dir))
    trained = model.lm.model.layers[0].self_attn.q_proj.weight
    assert not torch.equal(trained, base.model.layers[0].self_attn.q_proj.weight)
    assert tok.kind == "hf" and tok.eos_id == 1
    with pytest.raises(SystemExit) as exit_:
        main(["generate", str(hf_full_run), "--prompt", "reverse: red", "--max-new-tokens", "5",
              "--temperature", "0"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("reverse: red")

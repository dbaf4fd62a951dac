"""Packing changes nothing for a Hugging Face Llama either: each sequence of a packed window gets its logits, loss and
gradients alone (position_ids restarting at 0; transformers' masking_utils builds the mask); a model whose attention
would not keep the sequences apart is refused in one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kubetrain.config.loading import validate
from kubetrain.config.schema import ModelConfig
from kubetrain.data.loader import IGNORE_INDEX
from kubetrain.errors import ConfigError
from kubetrain.models.hf import HFCausalLM, load_hf_model
from kubetrain.train.model_for_world import keeps_sequences_apart

torch.set_num_threads(1)

LENGTHS = [7, 11, 5, 9]
WINDOW = 40


def llama(folder: Path, attention: str) -> HFCausalLM:
    model = load_hf_model(ModelConfig(kind="hf", name_or_path=str(folder), block_size=64), tokenizer_vocab=330)
    model.lm.set_attn_implementation(attention)
    return model.eval()


def packed_window() -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(5, 330, (n,), generator=g) for n in LENGTHS]
    fill = WINDOW - sum(LENGTHS)
    ids = torch.cat([*seqs, torch.full((fill,), 4)])[None]
    pos = torch.cat([torch.arange(n) for n in [*LENGTHS, fill]])[None]
    labels = torch.cat([*(torch.cat([s[1:], torch.tensor([IGNORE_INDEX])]) for s in seqs),
                        torch.full((fill,), IGNORE_INDEX)])[None]
    return seqs, ids, pos, labels


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_each_sequence_in_a_packed_window_has_its_logits_alone(llama_dir: Path, attention: str) -> None:
    model = llama(llama_dir, attention)
    seqs, ids, pos, _ = packed_window()
    with torch.no_grad():
        packed = model(ids, position_ids=pos)[0]
        plain = model(ids)[0]
        at = 0
        for s in seqs:
            alone = model(s[None])[0]
            torch.testing.assert_close(packed[at : at + len(s)], alone, atol=1e-5, rtol=1e-5)
            at += len(s)
    assert (plain[LENGTHS[0] :] - packed[LENGTHS[0] :]).abs().max() > 1e-3  # without position_ids they mix


def test_packed_loss_and_weight_gradients_are_the_sums_over_sequences_alone(llama_dir: Path) -> None:
    packed_model, alone_model = llama(llama_dir, "sdpa"), llama(llama_dir, "sdpa")
    seqs, ids, pos, labels = packed_window()
    packed_loss = packed_model(ids, labels=labels, position_ids=pos)
    packed_loss.backward()
    alone_loss: Any = sum(alone_model(s[None], labels=torch.cat([s[1:], torch.tensor([IGNORE_INDEX])])[None])
                          for s in seqs)
    alone_loss.backward()
    torch.testing.assert_close(packed_loss, alone_loss, atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(packed_model.named_parameters(), alone_model.parameters(), strict=True):
        if p.grad is not None or q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-5, msg=name)


def test_an_attention_that_gets_no_packed_mask_is_refused_in_one_line(llama_dir: Path, tmp_path: Path) -> None:
    """A kernel registered with transformers' AttentionInterface but not its mask interface gets no mask at all
    (masking_utils returns None for it): packed sequences would attend to each other, and kubetrain says so."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register("unmasked_sdpa", sdpa_attention_forward)
    model = llama(llama_dir, "unmasked_sdpa")
    seqs, ids, pos, _ = packed_window()
    with torch.no_grad():
        second = model(ids, position_ids=pos)[0, LENGTHS[0] : LENGTHS[0] + LENGTHS[1]]
        assert (second - model(seqs[1][None])[0]).abs().max() > 1e-3  # the harm the refusal prevents
    chat = tmp_path / "c.jsonl"
    chat.write_text('{"prompt": "a", "response": "b"}\n')
    cfg = validate({"data": {"sources": [{"kind": "chat", "path": str(chat)}], "chat": {"packing": True}},
                    "model": {"kind": "hf", "name_or_path": str(llama_dir), "block_size": 64}})
    with pytest.raises(ConfigError) as refused:
        keeps_sequences_apart(model, cfg)
    message = str(refused.value)
    assert "\n" not in message and "unmasked_sdpa" in message and "data.chat.packing false" in message
    unpacked = cfg.model_copy(update={"data": cfg.data.model_copy(update={"chat": cfg.data.chat.model_copy(
        update={"packing": False})})})
    assert keeps_sequences_apart(model, unpacked) is model
    assert keeps_sequences_apart(llama(llama_dir, "sdpa"), cfg) is not None


def test_every_layer_shares_one_additive_mask_in_the_weights_dtype(llama_dir: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' boolean mask would be turned into a float one by SDPA in every layer, each backward keeping its
    copy; the packed window hands it one additive mask, made once, which every layer gets as it is."""
    model = llama(llama_dir, "sdpa")
    _, ids, pos, labels = packed_window()
    masks: list[torch.Tensor | None] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        masks.append(kwargs.get("attn_mask"))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    model(ids, labels=labels, position_ids=pos).backward()
    layers = len(model.blocks)
    assert len(masks) == layers and all(m is masks[0] for m in masks)
    assert masks[0] is not None and masks[0].dtype == torch.float32 and masks[0].shape == (1, 1, WINDOW, WINDOW)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_sliding_window_model_keeps_its_window_in_a_packed_window(attention: str) -> None:
    """A model with sliding-window layers gets transformers' own masks (which hold the window), not the shared one."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=330, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, sliding_window=4)
    lm = MistralForCausalLM(cfg)
    lm.set_attn_implementation(attention)
    model = HFCausalLM(lm, 64).eval()
    seqs, ids, pos, _ = packed_window()
    with torch.no_grad():
        packed = model(ids, position_ids=pos)[0]
        at = 0
        for s in seqs:  # each longer than the window of 4: a mask without the window would change every logit
            torch.testing.assert_close(packed[at : at + len(s)], model(s[None])[0], atol=1e-5, rtol=1e-5)
            at += len(s)

"""Our GPT: parameter count, FLOPs, causality, and logits equal to Hugging Face's Llama with our weights."""

from __future__ import annotations

import math

import pytest
import torch

from kubetrain.config import ModelConfig
from kubetrain.models import build_model, gpt_config
from kubetrain.models.gpt import GPT, Block, GPTConfig, RMSNorm, apply_rope, rope_cache

torch.set_num_threads(1)


def small(**kw: object) -> GPTConfig:
    base: dict[str, object] = {"vocab_size": 96, "block_size": 16, "n_layer": 2, "n_head": 4, "n_embd": 32}
    return GPTConfig(**{**base, **kw})  # type: ignore[arg-type]


def expected_params(c: GPTConfig) -> int:
    """Counted by hand from the architecture, independently of the module tree."""
    attn = 4 * c.n_embd * c.n_embd  # q, k, v, o without bias
    mlp = 3 * c.n_embd * c.hidden  # gate, up, down
    norms = 2 * c.n_embd
    head = 0 if c.tie_embeddings else c.vocab_size * c.n_embd
    return c.vocab_size * c.n_embd + c.n_layer * (attn + mlp + norms) + c.n_embd + head


@pytest.mark.parametrize("tied", [True, False])
def test_parameter_count_matches_a_count_by_hand(tied: bool) -> None:
    c = small(tie_embeddings=tied)
    model = GPT(c)
    assert model.num_params() == expected_params(c)
    assert c.parameters == model.num_params()  # what the memory estimate counts without building the model
    assert model.num_params(non_embedding=True) == expected_params(c) - c.vocab_size * c.n_embd
    assert (model.lm_head.weight is model.embed.weight) == tied


def test_swiglu_width_defaults_to_eight_thirds_rounded_to_64() -> None:
    assert small(n_embd=384).hidden == 1024
    assert small(n_embd=768).hidden == 2048
    assert small(n_embd=32).hidden == 128
    assert small(mlp_hidden=50).hidden == 50


@pytest.mark.parametrize("tied", [True, False])
def test_flops_per_token_counts_every_matmul_once(tied: bool) -> None:
    c = small(tie_embeddings=tied)
    # 6 FLOPs per weight of every matmul (blocks + lm_head, not the embedding lookup) + causal attention.
    matmul_weights = c.n_layer * (4 * c.n_embd**2 + 3 * c.n_embd * c.hidden) + c.vocab_size * c.n_embd
    attention = 12 * c.n_layer * c.n_embd * c.block_size
    norms = (2 * c.n_layer + 1) * c.n_embd
    assert GPT(c).flops_per_token() == pytest.approx(6 * (matmul_weights + norms) + attention)


def test_gpt2_small_shape_has_the_expected_size() -> None:
    c = GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    assert expected_params(c) == pytest.approx(124e6, rel=0.02)  # the Llama-style 124M


def test_logits_shape_and_dtype() -> None:
    model = GPT(small())
    logits = model(torch.randint(0, 96, (3, 10)))
    assert logits.shape == (3, 10, 96)
    assert logits.dtype == torch.float32


def test_longer_than_block_size_is_refused() -> None:
    with pytest.raises(ValueError, match="longer than block_size 16"):
        GPT(small())(torch.zeros(1, 17, dtype=torch.long))


def test_causal_a_future_token_does_not_change_earlier_logits() -> None:
    torch.manual_seed(0)
    model = GPT(small()).eval()
    x = torch.randint(0, 96, (2, 12))
    y = x.clone()
    y[:, 7] = (y[:, 7] + 1) % 96
    with torch.no_grad():
        a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_prefix_logits_do_not_depend_on_the_length() -> None:
    model = GPT(small()).eval()
    x = torch.randint(0, 96, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(model(x[:, :5]), model(x)[:, :5], rtol=1e-5, atol=1e-5)


def test_init_is_seeded_and_scaled() -> None:
    torch.manual_seed(1)
    a = GPT(small(n_layer=8, n_embd=128))
    torch.manual_seed(1)
    b = GPT(small(n_layer=8, n_embd=128))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    block = a.blocks[0]
    assert isinstance(block, Block)
    assert block.attn.o_proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.1)
    assert block.attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert torch.equal(block.attn_norm.weight, torch.ones(128))


def test_untrained_loss_is_near_uniform() -> None:
    torch.manual_seed(0)
    model = GPT(small(vocab_size=256))
    x, targets = torch.randint(0, 256, (4, 16)), torch.randint(0, 256, (4, 16))
    # Small init: every token is about equally likely before training.
    loss = torch.nn.functional.cross_entropy(model(x).view(-1, 256), targets.view(-1))
    assert abs(loss.item() - math.log(256)) < 0.1


def test_one_step_of_adamw_lowers_the_loss_on_a_batch() -> None:
    torch.manual_seed(0)
    model = GPT(small())
    x = torch.randint(0, 96, (4, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def loss() -> torch.Tensor:
        return torch.nn.functional.cross_entropy(model(x[:, :-1]).reshape(-1, 96), x[:, 1:].reshape(-1))

    before = loss()
    before.backward()
    opt.step()
    assert loss().item() < before.item()
    assert all(p.grad is not None for p in model.parameters())


def test_dropout_is_active_only_in_training() -> None:
    model = GPT(small(dropout=0.5))
    x = torch.randint(0, 96, (2, 8))
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), model(x))
    model.train()
    with torch.no_grad():
        assert not torch.allclose(model(x), model(x))


def test_rope_at_position_zero_is_the_identity_and_preserves_norms() -> None:
    c = small()
    cos, sin = rope_cache(c)
    x = torch.randn(1, 4, 16, c.head_dim)
    y = apply_rope(x, cos, sin)
    torch.testing.assert_close(y[:, :, 0], x[:, :, 0])
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))


def test_rope_equals_the_textbook_rotate_halves() -> None:
    c = small(rope_theta=123.0)
    cos, sin = rope_cache(c)
    x = torch.randn(2, 4, 16, c.head_dim)
    half = c.head_dim // 2
    inv = 1.0 / (123.0 ** (torch.arange(0, half).float() * 2 / c.head_dim))
    angle = torch.arange(16).float()[:, None] * inv
    x1, x2 = x[..., :half], x[..., half:]
    expected = torch.cat([x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()], dim=-1)
    torch.testing.assert_close(apply_rope(x, cos, sin), expected)


def test_rope_keeps_bf16_inputs_bf16() -> None:
    cos, sin = rope_cache(small())
    assert apply_rope(torch.randn(1, 4, 16, 8, dtype=torch.bfloat16), cos, sin).dtype == torch.bfloat16


def test_rmsnorm_matches_torch_forward_and_backward() -> None:
    ours, ref = RMSNorm(24, eps=1e-5), torch.nn.RMSNorm(24, eps=1e-5)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        ref.weight.copy_(ours.weight)
    x = torch.randn(3, 5, 24, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    grad = torch.randn(3, 5, 24)
    y, y_ref = ours(x), ref(x_ref)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)  # the same forward arithmetic
    y.backward(grad)
    y_ref.backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad)


def test_rmsnorm_backward_passes_gradcheck() -> None:
    norm = RMSNorm(6, eps=1e-5).double()
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    w = torch.empty(6, dtype=torch.float64).uniform_(0.5, 1.5).requires_grad_()
    def with_weight(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.func.functional_call(norm, {"weight": w}, (x,))
        return out

    assert torch.autograd.gradcheck(with_weight, (x, w))


def test_build_model_rounds_the_vocabulary_up_to_64() -> None:
    cfg = ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=16)
    assert gpt_config(cfg, 256).vocab_size == 256
    assert gpt_config(cfg, 300).vocab_size == 320
    model = build_model(cfg, 300)
    assert isinstance(model, GPT) and model.config.vocab_size == 320


def test_build_model_refuses_a_vocabulary_smaller_than_the_tokenizer() -> None:
    from kubetrain.errors import ConfigError

    with pytest.raises(ConfigError, match=r"model\.vocab_size \(128\) is smaller than the tokenizer's"):
        build_model(ModelConfig(n_layer=1, n_head=2, n_embd=32, vocab_size=128), 256)


# Hugging Face Llama equivalence: the export path relies on these names and this RoPE convention.

HF_NAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
BLOCK_NAMES = {
    "attn.q_proj": "self_attn.q_proj",
    "attn.k_proj": "self_attn.k_proj",
    "attn.v_proj": "self_attn.v_proj",
    "attn.o_proj": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "mlp_norm": "post_attention_layernorm",
    "mlp.gate_proj": "mlp.gate_proj",
    "mlp.up_proj": "mlp.up_proj",
    "mlp.down_proj": "mlp.down_proj",
}


def hf_name(name: str) -> str:
    if name in HF_NAMES:
        return HF_NAMES[name]
    _, i, rest = name.split(".", 2)
    module, param = rest.rsplit(".", 1)
    return f"model.layers.{i}.{BLOCK_NAMES[module]}.{param}"


@pytest.mark.parametrize("tied", [True, False])
def test_logits_equal_hugging_face_llama_with_the_same_weights(tied: bool) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    c = small(tie_embeddings=tied, rope_theta=500.0, norm_eps=1e-6, n_head=4, n_embd=64, mlp_hidden=96)
    ours = GPT(c).eval()
    # Random norm weights too, so a swapped norm would show.
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    hf_cfg = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.n_embd, intermediate_size=c.hidden,
        num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.n_head,
        max_position_embeddings=c.block_size,
        rms_norm_eps=c.norm_eps, rope_theta=c.rope_theta, tie_word_embeddings=tied, attention_bias=False,
        mlp_bias=False, hidden_act="silu",
    )
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    theirs = hf.state_dict()
    mapped = {hf_name(k): v for k, v in ours.state_dict().items()}
    assert set(mapped) == set(theirs)  # every weight has a counterpart, both ways
    hf.load_state_dict(mapped)
    x = torch.randint(0, c.vocab_size, (2, c.block_size))
    with torch.no_grad():
        expected = hf(input_ids=x).logits
        got = ours(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_one_cast_of_a_shared_input_gives_autocasts_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    from kubetrain.models import gpt

    cfg = gpt.GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    ids = torch.randint(0, 64, (2, 16))

    def logits_and_grads() -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = gpt.GPT(cfg)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(ids)
        logits.float().square().mean().backward()
        return [logits, *(p.grad for p in model.parameters() if p.grad is not None)]

    shared = logits_and_grads()
    monkeypatch.setattr(gpt, "autocast_input", lambda x: x)  # autocast casts for each projection again
    each = logits_and_grads()
    assert torch.equal(shared[0], each[0])  # the forward: bit for bit
    # the input's gradient from q, k and v is now summed in bf16 (as under FSDP's bf16 policy), not in fp32
    assert all(torch.allclose(a, b, rtol=2e-2, atol=2e-5) for a, b in zip(shared[1:], each[1:], strict=True))
    x = torch.randn(2, 3)
    assert gpt.autocast_input(x) is x  # no autocast: nothing to do

"""Sampling: greedy and seeded sampling, top-k, EOS, the context window, the model's mode kept."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kubetrain.models.gpt import GPT, GPTConfig
from kubetrain.models.sampling import Progress, generate

torch.set_num_threads(1)
VOCAB = 64


@pytest.fixture(scope="module")
def model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=8, n_layer=1, n_head=2, n_embd=32))


class Fixed(nn.Module):
    """A model whose next-token distribution is the same everywhere: softmax(bias)."""

    def __init__(self, bias: torch.Tensor) -> None:
        super().__init__()
        self.bias = nn.Parameter(bias)
        self.lengths: list[int] = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.lengths.append(ids.shape[1])
        return self.bias.expand(ids.shape[0], ids.shape[1], -1)


def test_greedy_is_argmax_and_repeatable(model: GPT) -> None:
    a = generate(model, [1, 2, 3], 12, block_size=8, temperature=0)
    b = generate(model, [1, 2, 3], 12, block_size=8, temperature=0)
    assert a == b and len(a) == 12
    with torch.no_grad():
        first = int(model(torch.tensor([[1, 2, 3]]))[0, -1].argmax())
    assert a[0] == first


def test_top_k_of_one_is_greedy(model: GPT) -> None:
    assert generate(model, [5], 10, 8, temperature=1.0, top_k=1, seed=3) == generate(model, [5], 10, 8, 0)


def test_the_same_seed_gives_the_same_text_and_another_seed_differs(model: GPT) -> None:
    a = generate(model, [1], 30, 8, temperature=1.5, top_k=None, seed=11)
    assert a == generate(model, [1], 30, 8, temperature=1.5, top_k=None, seed=11)
    assert a != generate(model, [1], 30, 8, temperature=1.5, top_k=None, seed=12)
    assert all(0 <= t < VOCAB for t in a)


def test_top_k_never_samples_outside_the_k_most_likely() -> None:
    bias = torch.linspace(0, 1, VOCAB)  # the most likely tokens are the last ones
    out = generate(Fixed(bias), [0], 200, 4, temperature=5.0, top_k=3, seed=0)
    assert set(out) <= {VOCAB - 1, VOCAB - 2, VOCAB - 3}
    assert len(set(out)) == 3  # a high temperature still samples among them


def test_stops_at_eos_without_returning_it() -> None:
    bias = torch.full((VOCAB,), -10.0)
    bias[7] = 10.0
    assert generate(Fixed(bias), [1, 2], 50, 4, temperature=0, eos_id=7) == []
    assert generate(Fixed(bias), [1, 2], 3, 4, temperature=0) == [7, 7, 7]


def test_the_context_is_cropped_to_the_block_size() -> None:
    m = Fixed(torch.zeros(VOCAB))
    generate(m, list(range(20)), 5, block_size=6, temperature=0)
    assert m.lengths == [6, 6, 6, 6, 6]


def test_a_prompt_longer_than_the_block_works_with_our_gpt(model: GPT) -> None:
    assert len(generate(model, list(range(30)), 4, 8, temperature=0)) == 4


def test_training_mode_is_restored(model: GPT) -> None:
    model.train()
    generate(model, [1], 2, 8, temperature=0)
    assert model.training
    model.eval()
    generate(model, [1], 2, 8, temperature=0)
    assert not model.training


def test_unseeded_sampling_leaves_the_global_generator_alone(model: GPT) -> None:
    torch.manual_seed(42)
    expected = torch.rand(3)
    torch.manual_seed(42)
    a = generate(model, [1], 20, 8, temperature=2.0, top_k=None)
    b = generate(model, [1], 20, 8, temperature=2.0, top_k=None)
    assert torch.equal(torch.rand(3), expected)
    assert a != b  # and each call draws a fresh seed


def test_no_gradients_are_kept(model: GPT) -> None:
    generate(model, [1], 3, 8)
    assert all(p.grad is None for p in model.parameters())


def test_an_empty_prompt_is_refused(model: GPT) -> None:
    with pytest.raises(ValueError, match="at least one token"):
        generate(model, [], 3, 8)


def test_samples_run_in_the_training_dtype(model: GPT) -> None:
    from kubetrain.train.device import autocast

    seen: list[torch.dtype] = []
    hook = model.lm_head.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    try:
        generate(model, [1, 2], 3, 8, temperature=0, autocast_ctx=autocast("bf16", torch.device("cpu")))
        assert seen and set(seen) == {torch.bfloat16}  # the training loop's autocast, as on a GPU
        seen.clear()
        generate(model, [1, 2], 3, 8, temperature=0)
        assert set(seen) == {torch.float32}
    finally:
        hook.remove()


class NoCache(nn.Module):
    """The same model without `new_kv_cache`: every token a full forward over the context (the reference)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.inner(ids)
        return out


def test_the_kv_cache_gives_the_tokens_of_full_forwards_one_token_per_forward() -> None:
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=2, n_embd=32))
    lengths: list[int] = []
    hook = gpt.register_forward_pre_hook(lambda m, args, kwargs: lengths.append(args[0].shape[1]), with_kwargs=True)
    try:
        cached = generate(gpt, [3, 1, 4, 1, 5], 10, 16, temperature=0)
        assert lengths == [5] + [1] * 9  # the prompt once, then one token per forward
        assert cached == generate(NoCache(gpt), [3, 1, 4, 1, 5], 10, 16, temperature=0)
        seeded = generate(gpt, [3, 1], 8, 16, temperature=1.0, top_k=None, seed=3)
        assert seeded == generate(NoCache(gpt), [3, 1], 8, 16, temperature=1.0, top_k=None, seed=3)
        lengths.clear()
        generate(gpt, [3, 1, 4], 20, 16, temperature=0)  # past the block: cropped full forwards, as before
        assert lengths[0] == 3 and max(lengths) == 16
    finally:
        hook.remove()


def test_a_filled_cache_takes_one_token_at_a_time() -> None:
    gpt = GPT(GPTConfig(vocab_size=VOCAB, block_size=8, n_layer=1, n_head=2, n_embd=32))
    cache = gpt.new_kv_cache()
    gpt(torch.tensor([[1, 2]]), kv_cache=cache)
    with pytest.raises(ValueError, match="one token per forward"):
        gpt(torch.tensor([[1, 2]]), kv_cache=cache)


def test_a_hugging_face_model_samples_with_its_cache(llama_dir: object) -> None:
    from kubetrain.config.schema import ModelConfig
    from kubetrain.models.hf import load_hf_model

    lm = load_hf_model(ModelConfig(kind="hf", name_or_path=str(llama_dir), block_size=32))
    with_cache = generate(lm, [5, 6, 7], 8, 32, temperature=0)
    assert with_cache == generate(NoCache(lm), [5, 6, 7], 8, 32, temperature=0)


def test_a_long_generation_says_how_far_it_is(model: GPT) -> None:
    said: list[str] = []
    out = generate(model, [1, 2], 6, 8, temperature=0, progress=Progress("sample", said.append, every=0))
    assert len(out) == 6
    # a line per token once `every` seconds have passed (here: at once), none after the last token
    assert [line.split(",")[0] for line in said] == [f"sample: {n}/6 tokens" for n in range(1, 6)]
    assert all(line.endswith(" tokens/s") for line in said)
    quiet: list[str] = []
    generate(model, [1, 2], 6, 8, temperature=0, progress=Progress("sample", quiet.append))  # the usual case
    assert quiet == []

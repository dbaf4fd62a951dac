"""Packing changes nothing, for our GPT: each sequence of a packed window gets its logits, loss and gradients alone.

The window's `position_ids` restart at 0 where a sequence starts; what follows the last sequence is padding (its own
sequence, no loss). fp32 on the CPU: equal to 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from kubetrain.data.loader import IGNORE_INDEX
from kubetrain.models import documents
from kubetrain.models.documents import block_causal_mask, sequence_ids
from kubetrain.models.gpt import GPT, GPTConfig
from kubetrain.train.loss import loss_step

torch.set_num_threads(1)

LENGTHS = [5, 9, 3, 7, 12, 4]  # sequences; windows of 24 hold several and some padding
WINDOW = 24


def model(**kw: object) -> GPT:
    torch.manual_seed(0)
    base: dict[str, object] = {"vocab_size": 64, "block_size": WINDOW, "n_layer": 2, "n_head": 4, "n_embd": 32}
    return GPT(GPTConfig(**{**base, **kw})).eval()  # type: ignore[arg-type]


def sequences() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, 64, (n,), generator=g) for n in LENGTHS]


def pack(seqs: list[torch.Tensor], bins: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Windows (B, WINDOW) of the sequences `bins` names, padded with 0s (a sequence of their own), their position
    ids and labels (each sequence's next tokens; none across a boundary, none on padding)."""
    ids, pos, labels = [], [], []
    for members in bins:
        row_ids, row_pos, row_labels = [], [], []
        for i in members:
            s = seqs[i]
            row_ids.append(s)
            row_pos.append(torch.arange(len(s)))
            row_labels.append(torch.cat([s[1:], torch.tensor([IGNORE_INDEX])]))
        fill = WINDOW - sum(len(s) for s in row_ids)
        row_ids.append(torch.zeros(fill, dtype=torch.long))
        row_pos.append(torch.arange(fill))
        row_labels.append(torch.full((fill,), IGNORE_INDEX))
        ids.append(torch.cat(row_ids))
        pos.append(torch.cat(row_pos))
        labels.append(torch.cat(row_labels))
    return torch.stack(ids), torch.stack(pos), torch.stack(labels)


def alone_labels(s: torch.Tensor) -> torch.Tensor:
    return torch.cat([s[1:], torch.tensor([IGNORE_INDEX])])[None]


BINS = [[0, 1, 2], [3, 4], [5]]


def test_sequence_ids_start_where_positions_restart() -> None:
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1]])
    assert sequence_ids(pos).tolist() == [[0, 0, 0, 1, 1, 2, 3, 3]]
    mask = block_causal_mask(pos)[0, 0]
    assert mask[4].tolist() == [False, False, False, True, True, False, False, False]
    assert mask[2].tolist() == [True, True, True, False, False, False, False, False]


@pytest.mark.parametrize("flex", [False, True], ids=["sdpa-mask", "flex-block-mask"])
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_each_sequence_in_a_packed_window_has_its_logits_alone(flex: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if flex:  # the kernel CUDA runs compiled, here eager: its block mask is what is checked
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        monkeypatch.setattr(documents.torch_compat, "flex_attention",
                            lambda device: (flex_attention, create_block_mask))
    gpt, seqs = model(), sequences()
    ids, pos, _ = pack(seqs, BINS)
    with torch.no_grad():
        packed = gpt(ids, position_ids=pos)
        for row, members in enumerate(BINS):
            at = 0
            for i in members:
                alone = gpt(seqs[i][None])[0]
                torch.testing.assert_close(packed[row, at : at + len(seqs[i])], alone, atol=1e-5, rtol=1e-5)
                at += len(seqs[i])


def test_a_packed_window_without_position_ids_mixes_its_sequences() -> None:
    """The property above is not trivial: plain causal attention over the same window changes later sequences."""
    gpt, seqs = model(), sequences()
    ids, _, _ = pack(seqs, BINS)
    with torch.no_grad():
        plain = gpt(ids)[0, 5:14]
        alone = gpt(seqs[1][None])[0]
    assert (plain - alone).abs().max() > 1e-3


def test_packed_loss_and_weight_gradients_are_the_sums_over_sequences_alone() -> None:
    seqs = sequences()
    packed_model, alone_model = model(), model()
    ids, pos, labels = pack(seqs, BINS)
    packed_loss = packed_model(ids, labels=labels, position_ids=pos)
    packed_loss.backward()
    alone_loss = sum(alone_model(s[None], labels=alone_labels(s)) for s in seqs)
    assert isinstance(alone_loss, torch.Tensor)
    alone_loss.backward()
    torch.testing.assert_close(packed_loss, alone_loss, atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(packed_model.named_parameters(), alone_model.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-5, msg=name)


def test_shuffling_which_sequences_share_a_window_changes_no_sequence_loss() -> None:
    gpt, seqs = model(), sequences()

    def per_sequence_losses(bins: list[list[int]]) -> dict[int, float]:
        ids, pos, labels = pack(seqs, bins)
        out = {}
        with torch.no_grad():
            for row, members in enumerate(bins):
                for i in members:  # only this sequence's labels count
                    only = torch.full_like(labels[row : row + 1], IGNORE_INDEX)
                    at = sum(len(seqs[j]) for j in members[: members.index(i)])
                    only[0, at : at + len(seqs[i])] = labels[row, at : at + len(seqs[i])]
                    out[i] = float(gpt(ids[row : row + 1], labels=only, position_ids=pos[row : row + 1]))
        return out

    first = per_sequence_losses(BINS)
    shuffled = per_sequence_losses([[4, 0], [2, 5, 1], [3]])
    assert first.keys() == shuffled.keys() == set(range(len(seqs)))
    for i in first:
        assert shuffled[i] == pytest.approx(first[i], rel=1e-5, abs=1e-5)


def test_the_compiled_step_gives_the_eager_loss_on_a_packed_window() -> None:
    gpt, seqs = model(), sequences()
    ids, pos, labels = pack(seqs, BINS)
    eager = loss_step(gpt, compiled=False)(ids, labels, pos)
    torch._dynamo.reset()
    compiled = loss_step(gpt, compiled=True, backend="aot_eager")(ids, labels, pos)
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)


def test_dropout_uses_the_sdpa_mask_even_where_flex_attention_is_offered(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    monkeypatch.setattr(documents.torch_compat, "flex_attention", lambda device: (flex_attention, create_block_mask))
    pos = torch.tensor([[0, 1, 0, 1]])
    assert documents.document_mask(pos, dropout=0.1).dense is not None
    assert documents.document_mask(pos, dropout=0.0).block is not None

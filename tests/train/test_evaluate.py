"""The loss the loop trains on."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kubetrain.data.loader import IGNORE_INDEX
from kubetrain.train.evaluate import lm_loss, perplexity


def test_loss_is_the_mean_over_counted_positions() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    labels = torch.randint(0, 11, (2, 5))
    labels[0, :3] = IGNORE_INDEX
    expected = F.cross_entropy(logits.view(-1, 11), labels.view(-1), ignore_index=IGNORE_INDEX)
    assert torch.allclose(lm_loss(logits, labels), expected)


def test_batch_without_counted_positions_gives_zero_not_nan() -> None:
    logits = torch.randn(1, 4, 7, requires_grad=True)
    labels = torch.full((1, 4), IGNORE_INDEX)
    loss = lm_loss(logits, labels)
    loss.backward()
    assert loss.item() == 0.0 and torch.isfinite(logits.grad).all()  # type: ignore[union-attr]
    assert perplexity(1000.0) > 0

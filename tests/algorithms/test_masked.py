"""Masked primitives and loss aggregation (``masked.py``, docs/algorithms/aggregation.md)."""

from __future__ import annotations

import pytest
import torch
from tolerance import approx

from trinity_trl.algorithms import agg_loss


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_agg_loss_modes_by_hand(mode):
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    expected = {
        "token-mean": 7.0 / 3,
        "seq-mean-token-sum": (3.0 + 4.0) / 2,
        "seq-mean-token-mean": (1.5 + 4.0) / 2,
        "seq-mean-token-sum-norm": 7.0 / 3,
    }[mode]
    assert agg_loss(x, m, mode).item() == approx(expected, terms=x.numel())  # float32 sums of the values


def test_agg_loss_float_mask_is_a_weight_and_normalizer():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    w = torch.tensor([[0.5, 1.0], [0.0, 2.0]])
    assert agg_loss(x, w, "token-mean").item() == approx((0.5 + 2.0 + 8.0) / 3.5, terms=4)
    assert agg_loss(x, w, "seq-mean-token-sum-norm", normalizer=10).item() == approx(10.5 / 10, terms=4)


def test_agg_loss_empty_rows_and_unknown_mode():
    x = torch.ones(2, 3)
    m = torch.tensor([[1, 1, 1], [0, 0, 0]], dtype=torch.bool)
    assert agg_loss(x, m, "seq-mean-token-mean").item() == approx(0.5, terms=6)  # empty row counts in B
    assert agg_loss(x, torch.zeros_like(m), "token-mean").item() == 0.0
    with pytest.raises(ValueError, match="token-mean"):
        agg_loss(x, m, "sum")

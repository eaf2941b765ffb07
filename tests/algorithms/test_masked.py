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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_agg_loss_is_bit_identical_to_the_documented_formulas(dtype):
    """The modes are built from their declarations (AGGREGATION_MODES) but keep the exact operations of the formulas in
    docs/algorithms/aggregation.md (MMEAN, MSUM_row then the mean over rows, ...): every result, to the bit."""
    generator = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 7, generator=generator) * 10).to(dtype)
    m = torch.rand(5, 7, generator=generator) > 0.4
    m[2] = False  # an empty row
    w = m.to(dtype)
    rows = (torch.where(m, x, torch.zeros((), dtype=dtype)) * w).sum(-1)
    expected = {
        "token-mean": (torch.where(m, x, torch.zeros((), dtype=dtype)) * w).sum() / (w.sum() + 1e-8),
        "seq-mean-token-sum": rows.mean(),
        "seq-mean-token-mean": (rows / (w.sum(-1) + 1e-8)).mean(),
        "seq-mean-token-sum-norm": (torch.where(m, x, torch.zeros((), dtype=dtype)) * w).sum() / (7 + 1e-8),
    }
    for mode, value in expected.items():
        assert torch.equal(agg_loss(x, m, mode), value), mode

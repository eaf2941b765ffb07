"""REINFORCE++ (docs/algorithms/advantages.md#batch-functions, reference values
docs/algorithms/reference-values.md#batch-advantage-values) and the discounted scan it shares with GAE."""

from __future__ import annotations

import pytest
import torch
from tolerance import approx, assert_close

from trinity_trl.algorithms.advantage.reinforceplusplus import discounted_reverse_cumsum

from ..conftest import make_batch
from .batch_support import BATCH_TERMS, assert_rows, naive_discounted_sum, run_fn


def test_reinforceplusplus_gamma_one():
    batch, metrics = run_fn("reinforceplusplus")
    assert metrics == {}
    assert_rows(batch["advantages"], [1.2574311, -1.5779527, -0.1602608, 1.2574311, -1.0108759, 0.406816])
    # returns = G, unmasked: γ = 1 puts the row reward on every position up to it
    expected_returns = naive_discounted_sum(make_batch()["token_level_rewards"], 1.0).to(torch.float32)
    assert_close(batch["returns"], expected_returns, terms=5)  # sums over a row of 5 tokens


def test_reinforceplusplus_gamma_09_row0():
    batch, _ = run_fn("reinforceplusplus", gamma=0.9)
    expected = [0.7903844, 1.0431250, 1.3239480, 1.6359736, 0.0]
    assert batch["advantages"][0].tolist() == approx(expected, terms=BATCH_TERMS, scale=2.0)
    assert batch["returns"][0].tolist() == approx([0.729, 0.81, 0.9, 1.0, 0.0], terms=BATCH_TERMS, scale=2.0)


@pytest.mark.parametrize("width", [1, 2, 3, 5, 8, 13, 64, 100])
@pytest.mark.parametrize("discount", [0.0, 0.5, 0.9, 0.99, 1.0])
def test_discounted_reverse_cumsum_matches_loop(width, discount):
    g = torch.Generator().manual_seed(width)
    x = torch.randn(4, width, generator=g)
    result = discounted_reverse_cumsum(x, discount)
    assert result.shape == x.shape and result.dtype == x.dtype
    # float32 against a float64 loop: a running sum over the row; its rounding is relative to the partial sums, which
    # are the results themselves (the default scale)
    assert_close(result.double(), naive_discounted_sum(x, discount), terms=width, dtype=torch.float32)
    assert torch.equal(x, torch.randn(4, width, generator=torch.Generator().manual_seed(width)))  # input untouched


def test_discounted_reverse_cumsum_1d_and_float64():
    x = torch.randn(37, dtype=torch.float64)
    assert_close(discounted_reverse_cumsum(x, 0.8), naive_discounted_sum(x, 0.8), terms=37)


def test_nan_in_padded_reward_reaches_reinforceplusplus():
    """Documented reference behaviour: no reset at padding, then a global whitening."""
    batch = make_batch()
    batch["token_level_rewards"][0, 4] = float("nan")
    out, _ = run_fn("reinforceplusplus", batch)
    assert torch.isnan(out["advantages"][batch["response_mask"]]).all()

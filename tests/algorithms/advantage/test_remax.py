"""ReMax (docs/algorithms/advantages.md#batch-functions, reference values
docs/algorithms/reference-values.md#batch-advantage-values)."""

from __future__ import annotations

import torch

from ..conftest import ROW_REWARDS, make_batch
from .batch_support import assert_rows, nan_padded, run_fn


def test_remax():
    batch = make_batch()
    batch["reward_baselines"] = torch.tensor([0.5, 0.5, 0.5, 0.1, 0.1, 0.0])
    batch, metrics = run_fn("remax", batch)
    assert metrics == {}
    assert_rows(batch["advantages"], [0.5, -0.5, 0.0, 0.9, 0.1, 0.7])
    assert_rows(batch["returns"], ROW_REWARDS)


def test_nan_padding_does_not_leak_into_remax():
    batch = nan_padded(make_batch(), "token_level_rewards")
    batch["reward_baselines"] = torch.tensor([0.5, 0.5, 0.5, 0.1, 0.1, 0.0])
    out, _ = run_fn("remax", batch)
    assert_rows(out["advantages"], [0.5, -0.5, 0.0, 0.9, 0.1, 0.7])
    assert torch.isfinite(out["advantages"]).all() and torch.isfinite(out["returns"]).all()

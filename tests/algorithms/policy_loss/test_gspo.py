"""GSPO policy loss (docs/algorithms/policy-losses.md#gspo): docs/algorithms/reference-values.md#policy-loss-values
numbers, the per-token gradient of the sequence ratio, bad args."""

from __future__ import annotations

import logging

import pytest
import torch
from tolerance import assert_close

from ..support import MEAN_EPSILON, PPO_KL, _assert_off_edges, _grad, assert_reference_values, build, small_data

REFERENCE = [
    # (key, overrides, loss, metrics)
    ("gspo", {}, 0.27235108613967896,
     {"pg_clipfrac": 0.375, "ppo_kl": PPO_KL, "ppo_kl_seq": -0.21027061343193054}),
    ("gspo", {"loss_agg_mode": "token-mean"}, 0.2790028154850006, {}),
]  # fmt: skip


@pytest.mark.parametrize("key, overrides, loss, metrics", REFERENCE)
def test_reference_values(policy_data, key, overrides, loss, metrics):
    assert_reference_values(policy_data, key, overrides, loss, metrics)


def test_gspo_warns_only_for_other_modes(caplog):
    with caplog.at_level(logging.WARNING):
        build("gspo")
    assert not caplog.records
    with caplog.at_level(logging.WARNING):
        build("gspo", loss_agg_mode="token-mean")
    assert "token-mean" in caplog.text and "seq-mean-token-mean" in caplog.text


@pytest.mark.parametrize("loss_agg_mode", ["seq-mean-token-mean", "token-mean"])
def test_gspo_gradcheck_with_sequence_advantages(loss_agg_mode):
    """With one advantage per row, the token-form gradient ``s·∇ℓ`` is the true derivative
    (docs/algorithms/trl-differences.md#gspo)."""
    data = small_data()
    data["advantages"] = torch.tensor([0.7, -0.4, 0.9, -0.8], dtype=torch.float64)
    fn = build("gspo", clip_range_low=0.05, clip_range_high=0.05, loss_agg_mode=loss_agg_mode)
    mask = data["action_mask"]
    seq_ratio = torch.exp(((data["logprob"] - data["old_logprob"]) * mask).sum(-1) / mask.sum(-1))
    _assert_off_edges(seq_ratio, [0.95, 1.05])
    logprob = data.pop("logprob").clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda lp: fn(logprob=lp, **data)[0], (logprob,), eps=1e-6, atol=1e-6)
    (grad,) = torch.autograd.grad(fn(logprob=logprob, **data)[0], logprob)
    assert (grad != 0).any()  # not vacuous: some rows are unclipped


def test_gspo_gradient_is_sequence_ratio_per_token():
    data = small_data()
    mask, adv = data["action_mask"], data["advantages"]
    n_row = mask.sum(-1, keepdim=True)
    seq_ratio = torch.exp(((data["logprob"] - data["old_logprob"]) * mask).sum(-1, keepdim=True) / n_row)
    fn = build("gspo", clip_range_low=0.05, clip_range_high=0.05)
    clipped = ((seq_ratio > 1.05) & (adv > 0)) | ((seq_ratio < 0.95) & (adv < 0))
    assert clipped[mask].any() and (~clipped[mask]).any()
    expected = torch.where(clipped | ~mask, torch.zeros_like(adv), -adv * seq_ratio / (n_row * mask.shape[0]))
    assert_close(_grad(fn, data), expected, known_rtol=MEAN_EPSILON)


BAD_ARGS = [
    ("gspo", {"loss_agg_mode": "mean"}, "Unknown loss_agg_mode 'mean'"),
    ("gspo", {"clip_range_low": None}, "unresolved"),
    ("gspo", {"clip_range_high": -0.1}, "must be >= 0"),
]


@pytest.mark.parametrize("key, overrides, message", BAD_ARGS)
def test_bad_arguments(key, overrides, message):
    with pytest.raises(ValueError, match=message):
        build(key, **overrides)

"""SFT losses: plain, importance-weighted and φ-weighted (docs/algorithms/policy-losses.md#sft)."""

from __future__ import annotations

import pytest
import torch
from tolerance import assert_close

from trinity_trl.algorithms import phi_function

from ..support import MEAN_EPSILON, _grad, assert_reference_values, build, small_data

REFERENCE = [
    # (key, overrides, loss, metrics)
    ("sft", {}, -0.07560186833143234, {}),
    ("sft", {"loss_agg_mode": "seq-mean-token-sum"}, -0.7257779240608215, {}),
    ("sft", {"loss_agg_mode": "seq-mean-token-mean"}, -0.06965617835521698, {}),
    ("sft", {"loss_agg_mode": "seq-mean-token-sum-norm"}, -0.18144448101520538, {}),
    ("sft_is", {}, -0.46196869015693665, {}),
    ("sft_phi", {}, 0.655408501625061, {}),
    ("sft_phi", {"cutoff_prob": 0.8}, -0.13724572956562042, {}),
]  # fmt: skip


@pytest.mark.parametrize("key, overrides, loss, metrics", REFERENCE)
def test_reference_values(policy_data, key, overrides, loss, metrics):
    assert_reference_values(policy_data, key, overrides, loss, metrics)


def test_sft_phi_gradient_is_zero_above_cutoff():
    data = small_data()
    mask = data["action_mask"]
    cutoff = 0.4
    p = torch.exp(data["logprob"])
    above = p > cutoff
    assert above[mask].any() and (~above[mask]).any()
    expected = torch.where(above | ~mask, torch.zeros_like(p), -phi_function(p) / mask.sum())
    assert_close(_grad(build("sft_phi", cutoff_prob=cutoff), data), expected, known_rtol=MEAN_EPSILON)


BAD_ARGS = [
    ("sft", {"loss_agg_mode": "x"}, "Unknown loss_agg_mode"),
    ("sft_is", {"loss_agg_mode": "x"}, "Unknown loss_agg_mode"),
    ("sft_phi", {"cutoff_prob": 0.0}, r"cutoff_prob must be in \(0, 1\], got 0.0"),
    ("sft_phi", {"cutoff_prob": 1.2}, "cutoff_prob must be in"),
    ("sft_phi", {"loss_agg_mode": "x"}, "Unknown loss_agg_mode"),
]


@pytest.mark.parametrize("key, overrides, message", BAD_ARGS)
def test_bad_arguments(key, overrides, message):
    with pytest.raises(ValueError, match=message):
        build(key, **overrides)

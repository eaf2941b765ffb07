"""CISPO policy loss (docs/algorithms/policy-losses.md#cispo): docs/algorithms/reference-values.md#policy-loss-values
numbers, gradient, bad args."""

from __future__ import annotations

import pytest
import torch
from tolerance import assert_close

from ..support import MEAN_EPSILON, PPO_KL, _grad, assert_reference_values, build, small_data

REFERENCE = [
    # (key, overrides, loss, metrics)
    ("cispo", {}, -0.015564538538455963, {"unmasked_frac": 1.0, "ppo_kl": PPO_KL}),
    ("cispo", {"enable_mask_clip": True}, 0.04039409011602402, {"unmasked_frac": 0.8125}),
    ("cispo", {"enable_mask_clip": True, "mask_clip_range_low": 0.2, "mask_clip_range_high": 0.2},
     0.05443551763892174, {"unmasked_frac": 0.6458333134651184}),
]  # fmt: skip


@pytest.mark.parametrize("key, overrides, loss, metrics", REFERENCE)
def test_reference_values(policy_data, key, overrides, loss, metrics):
    assert_reference_values(policy_data, key, overrides, loss, metrics)


def test_cispo_gradient_is_clipped_weight_times_reinforce():
    data = small_data()
    mask, adv = data["action_mask"], data["advantages"]
    n = mask.sum()
    ratio = torch.exp(data["logprob"] - data["old_logprob"])
    for overrides in ({}, {"clip_range_low": 0.2, "clip_range_high": 0.2, "enable_mask_clip": True,
                           "mask_clip_range_low": 0.1, "mask_clip_range_high": 0.1}):  # fmt: skip
        fn = build("cispo", **overrides)
        w = ratio.clamp(1 - fn.clip_range_low, 1 + fn.clip_range_high)
        keep = torch.ones_like(ratio)
        if fn.enable_mask_clip:
            too_high = (ratio > 1 + fn.mask_clip_range_high) & (adv > 0)
            too_low = (ratio < 1 - fn.mask_clip_range_low) & (adv < 0)
            keep = (~(too_high | too_low)).double()
            assert 0 < keep[mask].sum() < mask.sum()  # the mask really drops some tokens here
        assert_close(_grad(fn, data), -adv * w * keep * mask / n, known_rtol=MEAN_EPSILON)


@pytest.mark.parametrize(
    "low, high, capped_below",
    [(1.0, 0.28, False), (0.2, 0.2, True), (0.0, 0.0, True)],
    ids=["default", "narrow", "none"],
)
def test_pg_clipfrac_is_the_share_of_tokens_whose_weight_the_range_capped(low, high, capped_below):
    """Counted from the ratios, at either bound and whatever the advantage; padding is not counted (NaN there)."""
    data = small_data()
    mask = data["action_mask"]
    data["logprob"] = data["logprob"].masked_fill(~mask, float("nan"))
    ratio = torch.exp(data["logprob"] - data["old_logprob"])[mask]
    below, above = ratio < 1 - low, ratio > 1 + high
    assert bool(below.any()) is capped_below and above.any()  # the cases reach the bounds they test
    _, metrics = build("cispo", clip_range_low=low, clip_range_high=high)(**data)
    count = mask.sum().item()
    assert_close(metrics["pg_clipfrac"], (below | above).sum().item() / count, terms=count, known_rtol=MEAN_EPSILON)


BAD_ARGS = [
    ("cispo", {"loss_agg_mode": "sum"}, "allowed: token-mean"),
    ("cispo", {"clip_range_low": 1.5}, r"clip_range_low must be in \[0, 1.0\], got 1.5"),
    ("cispo", {"clip_range_high": -0.8}, "clip_range_high must be >= 0, got -0.8"),
    ("cispo", {"mask_clip_range_low": -0.1}, "mask_clip_range_low"),
    ("cispo", {"mask_clip_range_high": -1.0}, "mask_clip_range_high"),
]


@pytest.mark.parametrize("key, overrides, message", BAD_ARGS)
def test_bad_arguments(key, overrides, message):
    with pytest.raises(ValueError, match=message):
        build(key, **overrides)

"""sPPO policy loss (docs/algorithms/policy-losses.md#sppo): docs/algorithms/reference-values.md#policy-loss-values
numbers, gradient, the inclusive trust region, bad args."""

from __future__ import annotations

import pytest
import torch
from tolerance import assert_close

from ..support import MEAN_EPSILON, _grad, assert_reference_values, build, small_data

REFERENCE = [
    # (key, overrides, loss, metrics)
    ("sppo", {}, 0.01046084240078926, {"pg_clipfrac": 0.5625}),
]  # fmt: skip


@pytest.mark.parametrize("key, overrides, loss, metrics", REFERENCE)
def test_reference_values(policy_data, key, overrides, loss, metrics):
    assert_reference_values(policy_data, key, overrides, loss, metrics)


def test_sppo_gradient_is_reinforce_in_range_and_zero_outside():
    data = small_data()
    mask, adv = data["action_mask"], data["advantages"]
    ratio = torch.exp(data["logprob"] - data["old_logprob"])
    fn = build("sppo", epsilon=0.2)
    inside = (ratio >= 1 / 1.2) & (ratio <= 1.2)
    assert inside[mask].any() and (~inside[mask]).any()
    expected = torch.where(inside & mask, -adv / mask.sum(), torch.zeros_like(adv))
    assert_close(_grad(fn, data), expected, known_rtol=MEAN_EPSILON)


def test_sppo_range_is_inclusive():
    eps = 0.25
    logprob = torch.zeros(1, 3, dtype=torch.float64)
    # ratios exactly 1/(1+ε), 1+ε and just outside 1+ε
    old = -torch.log(torch.tensor([[1 / (1 + eps), 1 + eps, 1 + eps + 1e-3]], dtype=torch.float64))
    _, metrics = build("sppo", epsilon=eps)(
        logprob=logprob, old_logprob=old, advantages=torch.ones(1, 3, dtype=torch.float64),
        action_mask=torch.ones(1, 3, dtype=torch.bool),
    )  # fmt: skip
    assert metrics["pg_clipfrac"] == pytest.approx(1 / 3)


BAD_ARGS = [
    ("sppo", {"epsilon": 0.0}, "epsilon must be > 0, got 0.0"),
    ("sppo", {"epsilon": -0.3}, "epsilon must be > 0"),
]


@pytest.mark.parametrize("key, overrides, message", BAD_ARGS)
def test_bad_arguments(key, overrides, message):
    with pytest.raises(ValueError, match=message):
        build(key, **overrides)

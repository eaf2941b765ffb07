"""TOPR policy loss (docs/algorithms/policy-losses.md#topr): docs/algorithms/reference-values.md#policy-loss-values
numbers and bad args (gradient: test_gradients.py)."""

from __future__ import annotations

import pytest

from ..support import AVG_RATIO, assert_reference_values, build

REFERENCE = [
    # (key, overrides, loss, metrics)
    ("topr", {}, -0.005364187061786652, {"avg_alpha": 0.9055275917053223, "avg_ratio": AVG_RATIO}),
]  # fmt: skip


@pytest.mark.parametrize("key, overrides, loss, metrics", REFERENCE)
def test_reference_values(policy_data, key, overrides, loss, metrics):
    assert_reference_values(policy_data, key, overrides, loss, metrics)


BAD_ARGS = [
    ("topr", {"loss_agg_mode": "x"}, "Unknown loss_agg_mode"),
]


@pytest.mark.parametrize("key, overrides, message", BAD_ARGS)
def test_bad_arguments(key, overrides, message):
    with pytest.raises(ValueError, match=message):
        build(key, **overrides)

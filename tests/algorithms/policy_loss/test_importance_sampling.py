"""Plain importance-sampling loss (docs/algorithms/policy-losses.md#importance-sampling):
docs/algorithms/reference-values.md#policy-loss-values numbers and bad args."""

from __future__ import annotations

import pytest

from ..support import AVG_RATIO, PPO_KL, assert_reference_values, build

REFERENCE = [
    # (key, overrides, loss, metrics)
    ("importance_sampling", {}, 0.1029665470123291, {"ratio/mean": AVG_RATIO, "approx_kl": PPO_KL}),
]  # fmt: skip


@pytest.mark.parametrize("key, overrides, loss, metrics", REFERENCE)
def test_reference_values(policy_data, key, overrides, loss, metrics):
    assert_reference_values(policy_data, key, overrides, loss, metrics)


BAD_ARGS = [
    ("importance_sampling", {"loss_agg_mode": "x"}, "Unknown loss_agg_mode"),
]


@pytest.mark.parametrize("key, overrides, message", BAD_ARGS)
def test_bad_arguments(key, overrides, message):
    with pytest.raises(ValueError, match=message):
        build(key, **overrides)

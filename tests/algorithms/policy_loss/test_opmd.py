"""OPMD policy loss (docs/algorithms/policy-losses.md#opmd): docs/algorithms/reference-values.md#policy-loss-values
numbers and bad args."""

from __future__ import annotations

import pytest

from ..support import assert_reference_values, build

REFERENCE = [
    # (key, overrides, loss, metrics)
    ("opmd", {}, -0.009589947760105133, {}),
    ("opmd", {"tau": 0.5}, -0.01278659701347351, {}),
]  # fmt: skip


@pytest.mark.parametrize("key, overrides, loss, metrics", REFERENCE)
def test_reference_values(policy_data, key, overrides, loss, metrics):
    assert_reference_values(policy_data, key, overrides, loss, metrics)


BAD_ARGS = [
    ("opmd", {"tau": -0.5}, "tau must be a finite number >= 0, got -0.5"),
    ("opmd", {"tau": float("nan")}, "tau must be"),
    ("opmd", {"loss_agg_mode": "x"}, "Unknown loss_agg_mode"),
]


@pytest.mark.parametrize("key, overrides, message", BAD_ARGS)
def test_bad_arguments(key, overrides, message):
    with pytest.raises(ValueError, match=message):
        build(key, **overrides)

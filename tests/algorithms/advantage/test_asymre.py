"""AsymRE group advantage (docs/algorithms/advantages.md#asymre, reference values
docs/algorithms/reference-values.md#group-advantage-values); ``asymre_verl``: test_batch_functions.py."""

from __future__ import annotations

from tolerance import approx

from .group_support import GROUP_TERMS, assert_task, run_fn


def test_asymre():
    out, metrics = run_fn("asymre")
    assert_task(out, 0, [0.6, -0.4, -0.4, 0.6])
    assert_task(out, 2, [0.1] * 4)
    assert_task(out, 3, [0.7])
    # the singleton reports b − shift = 0 + 0.1 (reference quirk)
    assert metrics["group_advantages/reward_mean/min"] == approx(0.1, terms=GROUP_TERMS, scale=2.0)
    assert metrics["group_advantages/group_baseline/min"] == approx(0.0, terms=GROUP_TERMS, scale=2.0)

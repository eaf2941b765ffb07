"""OPMD group advantage (docs/algorithms/advantages.md#opmd, reference values
docs/algorithms/reference-values.md#group-advantage-values); ``opmd_verl``: test_batch_functions.py."""

from __future__ import annotations

from tolerance import approx

from .group_support import GROUP_TERMS, assert_task, run_fn


def test_opmd_mean():
    out, metrics = run_fn("opmd")
    assert_task(out, 0, [0.5, -0.5, -0.5, 0.5])
    assert_task(out, 1, [0.075, -0.225, 0.475, -0.325])
    assert_task(out, 2, [0.0] * 4)
    assert_task(out, 3, [0.7])
    # singleton: baseline 0 but reward_mean is the group mean
    assert metrics["group_advantages/group_baseline/min"] == approx(0.0, terms=GROUP_TERMS, scale=2.0)
    assert metrics["group_advantages/reward_mean/max"] == approx(0.7, terms=GROUP_TERMS, scale=2.0)


def test_opmd_logavgexp():
    out, _ = run_fn("opmd", opmd_baseline="logavgexp", tau=0.5)
    # task 0 has rewards [1, 0, 0, 1]: equal rewards get equal scores
    assert_task(out, 0, [0.28310955, -0.71689045, -0.71689045, 0.28310955])
    assert_task(out, 1, [-0.02720642, -0.32720643, 0.37279356, -0.42720643])
    assert_task(out, 3, [0.7])

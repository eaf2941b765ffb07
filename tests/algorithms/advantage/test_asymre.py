"""AsymRE group advantage (docs/algorithms/advantages.md#asymre, reference values
docs/algorithms/reference-values.md#group-advantage-values); ``asymre_verl``: test_batch_functions.py."""

from __future__ import annotations

import pytest

from .group_support import assert_task, run_fn


def test_asymre():
    out, metrics = run_fn("asymre")
    assert_task(out, 0, [0.6, -0.4, -0.4, 0.6])
    assert_task(out, 2, [0.1] * 4)
    assert_task(out, 3, [0.7])
    # the singleton reports b − shift = 0 + 0.1 (reference quirk)
    assert metrics["group_advantages/reward_mean/min"] == pytest.approx(0.1, abs=1e-6)
    assert metrics["group_advantages/group_baseline/min"] == pytest.approx(0.0, abs=1e-6)

"""Raw-reward REINFORCE group advantage (docs/algorithms/advantages.md#reinforce)."""

from __future__ import annotations

import pytest

from ..conftest import GROUP_REWARDS
from .group_support import assert_advantage, by_run, run_fn


def test_reinforce_raw_reward():
    out, metrics = run_fn("reinforce")
    for (task, run), exp in by_run(out).items():
        assert_advantage(exp, GROUP_REWARDS[task][run])
    assert metrics["group_advantages/reward_mean/max"] == pytest.approx(0.7, abs=1e-6)
    assert metrics["group_advantages/reward_mean/min"] == pytest.approx(0.3, abs=1e-6)
    assert metrics["group_advantages/reward_mean/mean"] == pytest.approx((0.5 + 0.425 + 0.3 + 0.7) / 4, abs=1e-6)

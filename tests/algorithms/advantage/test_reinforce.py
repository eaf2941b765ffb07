"""Raw-reward REINFORCE group advantage (docs/algorithms/advantages.md#reinforce)."""

from __future__ import annotations

from tolerance import approx

from ..conftest import GROUP_REWARDS
from .group_support import GROUP_TERMS, assert_advantage, by_run, run_fn


def test_reinforce_raw_reward():
    out, metrics = run_fn("reinforce")
    for (task, run), exp in by_run(out).items():
        assert_advantage(exp, GROUP_REWARDS[task][run])
    assert metrics["group_advantages/reward_mean/max"] == approx(0.7, terms=GROUP_TERMS, scale=2.0)
    assert metrics["group_advantages/reward_mean/min"] == approx(0.3, terms=GROUP_TERMS, scale=2.0)
    assert metrics["group_advantages/reward_mean/mean"] == approx(
        (0.5 + 0.425 + 0.3 + 0.7) / 4, terms=GROUP_TERMS, scale=2.0
    )

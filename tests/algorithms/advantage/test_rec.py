"""REC group advantage (docs/algorithms/advantages.md#rec, reference values
docs/algorithms/reference-values.md#group-advantage-values)."""

from __future__ import annotations

import random

import pytest
import torch
from tolerance import approx

from trinity_trl.algorithms.advantage import ADVANTAGE_FN
from trinity_trl.algorithms.experience import EID, Experience

from ..conftest import make_group_experiences
from .group_support import GROUP_TERMS, assert_advantage, assert_task, run_fn


def test_rec_matches_opmd_without_singleton():
    out, metrics = run_fn("rec", exps=make_group_experiences(tasks=(0, 1, 2)))
    assert_task(out, 0, [0.5, -0.5, -0.5, 0.5])
    assert_task(out, 1, [0.075, -0.225, 0.475, -0.325])
    assert_task(out, 2, [0.0] * 4)
    assert metrics["group_advantages/drop_balance/max"] == 0.0


def test_rec_std_normalize():
    out, metrics = run_fn("rec", exps=make_group_experiences(tasks=(0, 1, 2)), std_normalize=True)
    assert_task(out, 0, [0.99999797, -0.99999797, -0.99999797, 0.99999797])
    assert_task(out, 1, [0.24096508, -0.72289503, 1.52611184, -1.0441817])
    # population std of task 0 rewards [1, 0, 0, 1] is 0.5 (the unbiased one would be 0.577)
    assert metrics["group_advantages/reward_std/max"] == approx(0.5, terms=GROUP_TERMS, scale=2.0)


@pytest.mark.parametrize("std_normalize", [False, True])
def test_rec_singleton_uses_zero_mean_unit_std(std_normalize):
    out, metrics = run_fn("rec", exps=make_group_experiences(tasks=(3,)), std_normalize=std_normalize, drop="balance")
    assert_advantage(out[0], 0.7 / (1 + 1e-6) if std_normalize else 0.7)
    assert metrics == {
        "group_advantages/drop_balance/mean": 0.0,
        "group_advantages/drop_balance/max": 0.0,
        "group_advantages/drop_balance/min": 0.0,
        "group_advantages/reward_mean/mean": 0.0,
        "group_advantages/reward_mean/max": 0.0,
        "group_advantages/reward_mean/min": 0.0,
        "group_advantages/reward_std/mean": 1.0,
        "group_advantages/reward_std/max": 1.0,
        "group_advantages/reward_std/min": 1.0,
    }


def test_rec_drop_balance_drops_exactly_n_minus_p_negatives():
    rewards = [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]  # mean 1/6: P = 1, N = 5 -> drop 4
    exps = [
        Experience(eid=EID(task=0, run=i), tokens=torch.arange(4), prompt_length=1, reward=r)
        for i, r in enumerate(rewards)
    ]
    random.seed(7)
    out, metrics = ADVANTAGE_FN.get("rec")(drop="balance")(exps)
    random.seed(7)
    expected_dropped = set(random.sample([1, 2, 3, 4, 5], 4))
    dropped = {exp.eid.run for exp in out if torch.all(exp.advantages == 0)}
    assert dropped == expected_dropped
    kept = [exp for exp in out if exp.eid.run not in dropped]
    assert sorted(exp.eid.run for exp in kept)[0] == 0 and len(kept) == 2
    # kept set {1.0, 0.0}: μ = 0.5
    for exp in kept:
        assert_advantage(exp, rewards[exp.eid.run] - 0.5)
    assert metrics["group_advantages/drop_balance/mean"] == approx(4 / 6, terms=GROUP_TERMS, scale=2.0)
    assert metrics["group_advantages/reward_mean/mean"] == approx(0.5, terms=GROUP_TERMS, scale=2.0)
    assert len(out) == 6  # dropped members stay, with advantage 0


def test_rec_drop_balance_keeps_all_when_positives_dominate():
    out, metrics = run_fn("rec", exps=make_group_experiences(tasks=(2,)), drop="balance")
    assert_task(out, 2, [0.0] * 4)
    assert metrics["group_advantages/drop_balance/max"] == 0.0

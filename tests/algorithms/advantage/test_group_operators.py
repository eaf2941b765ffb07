"""Behaviour every group (experience-operator) advantage function shares (docs/algorithms/advantages.md#two-kinds)."""

from __future__ import annotations

import pytest
import torch

from trinity_trl.algorithms.advantage import ADVANTAGE_FN

from ..conftest import make_group_experiences
from .group_support import run_fn

GROUP_KEYS = ["grpo", "step_wise_grpo", "opmd", "asymre", "reinforce", "rec"]


@pytest.mark.parametrize("key", GROUP_KEYS)
def test_empty_input(key):
    out, metrics = ADVANTAGE_FN.get(key)()([])
    assert out == []
    # grpo always reports filtered_count (docs/algorithms/advantages.md#grpo step 5)
    assert metrics == ({"filtered_count": 0} if key == "grpo" else {})


@pytest.mark.parametrize("key", ["grpo", "opmd", "asymre", "reinforce", "rec"])
def test_masked_tokens_are_zero_and_returns_equal_advantages(key):
    out, _ = run_fn(key, exps=make_group_experiences(tasks=(0, 1, 2)))
    odd_runs = [exp for exp in out if exp.eid.run % 2]
    assert odd_runs and any(exp.advantages[:3].abs().sum() > 0 for exp in odd_runs)
    for exp in out:
        assert torch.equal(exp.advantages[~exp.action_mask], torch.zeros(int((~exp.action_mask).sum())))
        assert torch.equal(exp.returns, exp.advantages) and exp.returns is not exp.advantages


@pytest.mark.parametrize("key", ["grpo", "opmd", "asymre", "reinforce", "rec"])
def test_missing_reward_is_an_error(key):
    exps = make_group_experiences(tasks=(0,))
    exps[2].reward = None
    with pytest.raises(ValueError, match=exps[2].eid.uid):
        ADVANTAGE_FN.get(key)()(exps)


@pytest.mark.parametrize(
    "key, kwargs, match",
    [
        ("grpo", {"std_cal_level": "none"}, "'group', 'batch'"),
        ("grpo", {"std_cal_level": "task"}, "std_cal_level"),
        ("grpo", {"epsilon": 0.0}, "epsilon"),
        ("grpo", {"epsilon": -1e-6}, "epsilon"),
        ("grpo", {"rank_penalty": 1.0}, "rank_penalty"),
        ("grpo", {"rank_penalty": -0.1}, "rank_penalty"),
        ("step_wise_grpo", {"std_cal_level": "task"}, "'group', 'batch', 'none'"),
        ("step_wise_grpo", {"epsilon": 0}, "epsilon"),
        ("opmd", {"opmd_baseline": "max"}, "'mean', 'logavgexp'"),
        ("opmd", {"tau": 0.0}, "tau"),
        ("opmd", {"tau": float("nan")}, "tau"),
        ("asymre", {"baseline_shift": float("inf")}, "baseline_shift"),
        ("rec", {"drop": "all"}, "None, 'balance'"),
        ("rec", {"epsilon": 0.0}, "epsilon"),
    ],
)
def test_bad_args(key, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ADVANTAGE_FN.get(key)(**kwargs)


@pytest.mark.parametrize("key", GROUP_KEYS)
def test_default_args_match_spec(key):
    expected = {
        "grpo": {
            "epsilon": 1e-6,
            "std_threshold": None,
            "duplicate_experiences": False,
            "rank_penalty": None,
            "std_cal_level": "group",
        },
        "step_wise_grpo": {"epsilon": 1e-6, "enable_step_norm": False, "std_threshold": None, "std_cal_level": "group"},
        "opmd": {"opmd_baseline": "mean", "tau": 1.0},
        "asymre": {"baseline_shift": -0.1},
        "reinforce": {},
        "rec": {"epsilon": 1e-6, "std_normalize": False, "drop": None},
    }[key]
    assert ADVANTAGE_FN.get(key).default_args() == expected
    assert ADVANTAGE_FN.get(key).compute_in_trainer() is False

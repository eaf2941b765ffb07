"""GRPO group advantage (docs/algorithms/advantages.md#grpo, reference values
docs/algorithms/reference-values.md#group-advantage-values)."""

from __future__ import annotations

import random

import pytest
import torch
from tolerance import approx

from trinity_trl.algorithms.advantage import ADVANTAGE_FN

from ..conftest import make_group_experiences
from .group_support import GROUP_TERMS, assert_advantage, assert_task, run_fn


def test_grpo_defaults_reference_values():
    out, metrics = run_fn("grpo")
    assert len(out) == 13
    assert_task(out, 0, [0.8660239, -0.8660239, -0.8660239, 0.8660239])
    assert_task(out, 1, [0.20868199, -0.6260457, 1.32165217, -0.90428835])
    assert_task(out, 2, [0.0] * 4)
    assert_task(out, 3, [0.69999933])
    expected = {
        "group_advantages/reward_mean/mean": 0.30625,
        "group_advantages/reward_mean/max": 0.5,
        "group_advantages/reward_mean/min": 0.0,
        "group_advantages/reward_std/mean": 0.48418697,
        "group_advantages/reward_std/max": 1.0,
        "group_advantages/reward_std/min": 0.0,
        "filtered_count": 0,
    }
    assert set(metrics) == set(expected)
    for key, value in expected.items():
        assert metrics[key] == approx(value, terms=GROUP_TERMS, scale=2.0), key


def test_grpo_batch_std():
    out, _ = run_fn("grpo", std_cal_level="batch")
    assert_task(out, 0, [1.39224958, -1.39224958, -1.39224958, 1.39224958])
    assert_task(out, 1, [0.20883749, -0.62651223, 1.32263708, -0.90496218])
    assert_task(out, 3, [1.94914937])


def test_grpo_std_threshold_filters_flat_and_singleton_groups():
    out, metrics = run_fn("grpo", std_threshold=0.0)
    assert len(out) == 8
    assert {exp.eid.task for exp in out} == {0, 1}
    assert metrics["filtered_count"] == 5
    # all 4 groups still reported: only the singleton has std 1, only task 2 has std 0
    assert metrics["group_advantages/reward_std/max"] == approx(1.0, terms=GROUP_TERMS, scale=2.0)
    assert metrics["group_advantages/reward_std/min"] == approx(0.0, terms=GROUP_TERMS, scale=2.0)
    assert metrics["group_advantages/reward_mean/mean"] == approx(0.30625, terms=GROUP_TERMS, scale=2.0)
    assert_task(out, 0, [0.8660239, -0.8660239, -0.8660239, 0.8660239])


def test_grpo_rank_penalty():
    out, _ = run_fn("grpo", rank_penalty=0.2)
    assert_task(out, 0, [0.99990797, -0.86038589, -0.86038589, 0.99990797])
    assert_task(out, 1, [0.32406616, -0.5597508, 1.50248885, -0.85435647])
    assert_task(out, 2, [1.16183424] * 4)


def test_grpo_rank_penalty_needs_logprobs():
    exps = make_group_experiences()
    exps[0].logprobs = None
    with pytest.raises(ValueError, match="logprobs"):
        ADVANTAGE_FN.get("grpo")(rank_penalty=0.2)(exps)


def test_grpo_output_is_in_group_order():
    exps = make_group_experiences()
    shuffled = [exps[i] for i in (12, 4, 0, 5, 8, 1, 9, 2, 3, 6, 7, 10, 11)]
    out, _ = run_fn("grpo", exps=shuffled)
    tids = [exp.eid.tid for exp in out]
    assert tids == ["0/3"] + ["0/1"] * 4 + ["0/0"] * 4 + ["0/2"] * 4
    # members keep input order inside a group
    assert [exp.eid.run for exp in out[1:5]] == [0, 1, 2, 3]
    assert [exp.eid.run for exp in out[5:9]] == [0, 1, 2, 3]
    assert out[0] is exps[12]  # written in place, not copied


def test_grpo_duplicate_experiences_refills_with_deep_copies():
    random.seed(1234)
    out, metrics = run_fn("grpo", std_threshold=0.0, duplicate_experiences=True)
    random.seed(1234)
    picks = random.choices(range(2), k=2)  # 2 kept groups (tasks 0, 1), 2 skipped (tasks 2, 3)
    assert metrics["filtered_count"] == 5
    assert len(out) == 8 + 4 * 2
    originals = out[:8]
    for copy_block, pick in zip((out[8:12], out[12:16]), picks):
        source = originals[4 * pick : 4 * pick + 4]
        for dup, orig in zip(copy_block, source):
            assert dup is not orig and dup.advantages is not orig.advantages
            assert dup.eid.uid == orig.eid.uid
            assert torch.equal(dup.advantages, orig.advantages)
            assert torch.equal(dup.returns, orig.returns)


def test_grpo_no_duplicates_without_threshold_or_when_nothing_is_skipped():
    out, _ = run_fn("grpo", duplicate_experiences=True)  # std_threshold None: nothing skipped
    assert len(out) == 13
    out, _ = run_fn("grpo", exps=make_group_experiences(tasks=(0, 1)), std_threshold=0.0, duplicate_experiences=True)
    assert len(out) == 8


@pytest.mark.parametrize("duplicate", [False, True])
def test_grpo_all_groups_skipped_gives_empty(duplicate):
    out, metrics = run_fn("grpo", std_threshold=10.0, duplicate_experiences=duplicate)
    assert out == []
    assert metrics["filtered_count"] == 13


def test_grpo_batch_std_with_one_experience_is_one():
    out, _ = run_fn("grpo", exps=make_group_experiences(tasks=(3,)), std_cal_level="batch")
    assert_advantage(out[0], 0.7 / (1.0 + 1e-6))


@pytest.mark.parametrize(
    "args",
    [
        {"epsilon": 1e-4},
        {"std_threshold": 0.0},
        {"std_threshold": 0.0, "duplicate_experiences": True},
        {"rank_penalty": 0.1},
        {"std_cal_level": "batch"},
    ],
)
def test_grpo_equals_trls_group_zscore_at_its_default_arguments_only(args):
    """The declared property the asynchronous trainers' vLLM path asks (docs/asynchronous.md#with-vllm)."""
    assert ADVANTAGE_FN.get("grpo")().equals_trl_group_zscore
    assert not ADVANTAGE_FN.get("grpo")(**args).equals_trl_group_zscore


def test_no_other_advantage_equals_trls_group_zscore():
    for name in ADVANTAGE_FN.names():
        if name != "grpo":
            assert not ADVANTAGE_FN.get(name)().equals_trl_group_zscore, name

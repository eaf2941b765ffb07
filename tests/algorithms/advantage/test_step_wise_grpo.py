"""Step-wise GRPO for multi-step runs (docs/algorithms/advantages.md#step-wise-grpo, reference values
docs/algorithms/reference-values.md#group-advantage-values)."""

from __future__ import annotations

import pytest
import torch
from tolerance import approx

from trinity_trl.algorithms.advantage import ADVANTAGE_FN
from trinity_trl.algorithms.experience import Experience, group_by

from ..conftest import make_step_experiences
from .group_support import GROUP_TERMS, assert_advantage


def assert_steps(out, task: int, per_run: list[float]) -> None:
    for exp in out:
        if exp.eid.task == task:
            assert_advantage(exp, per_run[exp.eid.run])


def test_step_wise_grpo_defaults():
    out, metrics = ADVANTAGE_FN.get("step_wise_grpo")()(make_step_experiences())
    assert len(out) == 11
    assert_steps(out, 0, [0.999998, -0.999998, 0.0])
    assert_steps(out, 1, [0.0, 0.0])
    assert_steps(out, 2, [0.8999991])
    expected = {
        "group_advantages/reward_mean/mean": 0.2333333,
        "group_advantages/reward_std/mean": 0.5,
        "experience_count": 11,
        "filtered_count": 0,
        "skipped_group_ratio": 0.0,
    }
    for key, value in expected.items():
        assert metrics[key] == approx(value, terms=GROUP_TERMS, scale=2.0), key


def test_step_wise_grpo_ignores_non_last_step_rewards():
    base, base_metrics = ADVANTAGE_FN.get("step_wise_grpo")()(make_step_experiences(9.0))
    other, other_metrics = ADVANTAGE_FN.get("step_wise_grpo")()(make_step_experiences(-100.0))
    assert base_metrics == other_metrics
    for a, b in zip(base, other):
        assert torch.equal(a.advantages, b.advantages)


def test_step_wise_grpo_output_order():
    exps = make_step_experiences()
    # interleave tasks; steps of each run stay in step order
    shuffled = [exps[i] for i in (10, 6, 0, 7, 1, 8, 2, 9, 3, 4, 5)]
    out, _ = ADVANTAGE_FN.get("step_wise_grpo")()(shuffled)
    assert [(e.eid.task, e.eid.run, e.eid.step) for e in out] == [
        (2, 0, 0),
        (1, 0, 0),
        (1, 0, 1),
        (1, 1, 0),
        (1, 1, 1),
        (0, 0, 0),
        (0, 1, 0),
        (0, 1, 1),
        (0, 2, 0),
        (0, 2, 1),
        (0, 2, 2),
    ]


def test_step_wise_grpo_step_norm():
    out, _ = ADVANTAGE_FN.get("step_wise_grpo")(enable_step_norm=True)(make_step_experiences())
    assert_steps(out, 0, [0.999998, -0.499999, 0.0])
    assert_steps(out, 2, [0.8999991])


def test_step_wise_grpo_batch_std():
    out, _ = ADVANTAGE_FN.get("step_wise_grpo")(std_cal_level="batch")(make_step_experiences())
    assert_steps(out, 0, [1.2247419, -1.2247419, 0.0])
    assert_steps(out, 2, [2.2045352])


def test_step_wise_grpo_no_std_division():
    out, _ = ADVANTAGE_FN.get("step_wise_grpo")(std_cal_level="none")(make_step_experiences())
    assert_steps(out, 0, [0.5, -0.5, 0.0])
    assert_steps(out, 2, [0.9])


def test_step_wise_grpo_std_threshold():
    out, metrics = ADVANTAGE_FN.get("step_wise_grpo")(std_threshold=0.0)(make_step_experiences())
    assert len(out) == 6 and {e.eid.task for e in out} == {0}
    assert metrics["experience_count"] == 6
    assert metrics["filtered_count"] == 5
    assert metrics["skipped_group_ratio"] == approx(0.6666667, terms=GROUP_TERMS, scale=2.0)
    assert metrics["group_advantages/reward_std/max"] == approx(
        1.0, terms=GROUP_TERMS, scale=2.0
    )  # skipped ones reported


def test_step_wise_grpo_ignores_extra_kwargs():
    fn = ADVANTAGE_FN.get("step_wise_grpo")(rank_penalty=0.1, duplicate_experiences=True)
    assert len(fn(make_step_experiences())[0]) == 11


def test_step_wise_grpo_needs_last_step_reward():
    exps = make_step_experiences()
    exps[0].reward = None  # the only step of run 0 of task 0
    with pytest.raises(ValueError, match="reward"):
        ADVANTAGE_FN.get("step_wise_grpo")()(exps)
    exps = make_step_experiences()
    exps[1].reward = None  # a non-last step: fine
    ADVANTAGE_FN.get("step_wise_grpo")()(exps)


def test_trinity_class_name_is_importable():
    from trinity_trl.algorithms import StepWiseGRPOAdvantageFn as from_package
    from trinity_trl.algorithms.advantage import StepWiseGRPOAdvantageFn as from_family
    from trinity_trl.algorithms.advantage.step_wise_grpo import StepWiseGRPOAdvantage

    assert from_package is from_family is StepWiseGRPOAdvantage is ADVANTAGE_FN.get("step_wise_grpo")


def last_steps_of_task_0():
    runs = group_by([e for e in make_step_experiences() if e.eid.task == 0], "run")
    return runs, {rid: steps[-1] for rid, steps in runs.items()}


@pytest.mark.parametrize("keyword", ["precomputed_std", "batch_std"])
def test_calculate_last_step_advantage_takes_the_precomputed_std(keyword):
    """Trinity's keyword is ``precomputed_std``; ``batch_std`` (the former name here) still works."""
    fn = ADVANTAGE_FN.get("step_wise_grpo")(std_cal_level="batch")
    _, last = last_steps_of_task_0()
    scores, metrics, skip = fn.calculate_last_step_advantage(exps=last, **{keyword: torch.tensor(0.5)})
    assert list(scores.values()) == approx([0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6), 0.0], terms=GROUP_TERMS, scale=2.0)
    assert metrics == pytest.approx({"reward_mean": 0.5, "reward_std": 0.5}) and skip is False
    positional, _, _ = fn.calculate_last_step_advantage(last, torch.tensor(0.5))
    assert positional == scores
    with pytest.raises(ValueError, match="precomputed_std or its old name batch_std"):
        fn.calculate_last_step_advantage(last, precomputed_std=torch.tensor(0.5), batch_std=torch.tensor(0.5))


def test_broadcast_advantages_returns_the_runs():
    fn = ADVANTAGE_FN.get("step_wise_grpo")(enable_step_norm=True)
    runs, last = last_steps_of_task_0()
    scores, _, _ = fn.calculate_last_step_advantage(last)
    returned = fn.broadcast_advantages(runs, scores)
    assert isinstance(returned, dict) and list(returned) == list(runs)
    assert all(type(steps) is list and all(isinstance(e, Experience) for e in steps) for steps in returned.values())
    run_1 = returned[next(rid for rid in returned if rid.endswith("/1"))]
    assert len(run_1) == 2
    for exp in run_1:  # updated in place, divided by the run's 2 steps
        assert_advantage(exp, -0.999998 / 2)

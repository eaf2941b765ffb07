"""Group (experience-operator) advantage functions: spec §12.3-§12.8, reference values §14.3."""

from __future__ import annotations

import random

import pytest
import torch

from trinity_trl.algorithms.advantage import ADVANTAGE_FN
from trinity_trl.algorithms.experience import EID, Experience

GROUP_REWARDS = {0: [1.0, 0.0, 0.0, 1.0], 1: [0.5, 0.2, 0.9, 0.1], 2: [0.3, 0.3, 0.3, 0.3], 3: [0.7]}


def make_group_experiences(tasks=(0, 1, 2, 3)) -> list[Experience]:
    """Spec §14.3: batch 0, 6 tokens with prompt_length 2, mask [1,1,1,1] (even run) / [1,1,1,0]
    (odd run), logprobs of run i constant −0.1·(i+1)."""
    exps = []
    for task in tasks:
        for run, reward in enumerate(GROUP_REWARDS[task]):
            mask = torch.tensor([1, 1, 1, 1] if run % 2 == 0 else [1, 1, 1, 0], dtype=torch.bool)
            exps.append(Experience(
                eid=EID(batch=0, task=task, run=run), tokens=torch.arange(6), prompt_length=2, reward=reward,
                logprobs=torch.full((4,), -0.1 * (run + 1)), action_mask=mask,
            ))
    return exps


def make_step_experiences(non_last_reward: float = 9.0) -> list[Experience]:
    """Spec §14.3 step-wise data: task 0 runs of 1/2/3 steps (last rewards 1.0, 0.0, 0.5), task 1
    two runs of 2 steps (0.2 each), task 2 one run of 1 step (0.9); mask [1,1,0]."""
    runs = {0: [(1, 1.0), (2, 0.0), (3, 0.5)], 1: [(2, 0.2), (2, 0.2)], 2: [(1, 0.9)]}
    exps = []
    for task, task_runs in runs.items():
        for run, (steps, last_reward) in enumerate(task_runs):
            for step in range(steps):
                exps.append(Experience(
                    eid=EID(batch=0, task=task, run=run, step=step), tokens=torch.arange(5), prompt_length=2,
                    reward=last_reward if step == steps - 1 else non_last_reward,
                    action_mask=torch.tensor([1, 1, 0], dtype=torch.bool),
                ))
    return exps


def by_run(exps):
    return {(exp.eid.task, exp.eid.run): exp for exp in exps}


def assert_advantage(exp: Experience, expected: float) -> None:
    """``expected`` on unmasked tokens, exactly 0 on masked ones, returns == advantages."""
    mask = exp.action_mask.bool()
    assert exp.advantages.dtype == torch.float32
    for value in exp.advantages[mask].tolist():
        assert value == pytest.approx(expected, abs=1e-6)
    assert torch.all(exp.advantages[~mask] == 0)
    assert torch.equal(exp.returns, exp.advantages)
    assert exp.returns is not exp.advantages


def assert_task(out, task: int, expected: list[float]) -> None:
    runs = by_run(out)
    for run, value in enumerate(expected):
        assert_advantage(runs[(task, run)], value)


def run_fn(key: str, exps=None, **kwargs):
    return ADVANTAGE_FN.get(key)(**kwargs)(make_group_experiences() if exps is None else exps)


# --------------------------------------------------------------------------------------------- grpo


def test_grpo_defaults_reference_values():
    out, metrics = run_fn("grpo")
    assert len(out) == 13
    assert_task(out, 0, [0.8660239, -0.8660239, -0.8660239, 0.8660239])
    assert_task(out, 1, [0.20868199, -0.6260457, 1.32165217, -0.90428835])
    assert_task(out, 2, [0.0] * 4)
    assert_task(out, 3, [0.69999933])
    expected = {
        "group_advantages/reward_mean/mean": 0.30625, "group_advantages/reward_mean/max": 0.5,
        "group_advantages/reward_mean/min": 0.0, "group_advantages/reward_std/mean": 0.48418697,
        "group_advantages/reward_std/max": 1.0, "group_advantages/reward_std/min": 0.0, "filtered_count": 0,
    }
    assert set(metrics) == set(expected)
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, abs=1e-6), key


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
    assert metrics["group_advantages/reward_std/max"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["group_advantages/reward_std/min"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["group_advantages/reward_mean/mean"] == pytest.approx(0.30625, abs=1e-6)
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
        source = originals[4 * pick: 4 * pick + 4]
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


# --------------------------------------------------------------------------------------------- opmd, asymre, reinforce, rec


def test_opmd_mean():
    out, metrics = run_fn("opmd")
    assert_task(out, 0, [0.5, -0.5, -0.5, 0.5])
    assert_task(out, 1, [0.075, -0.225, 0.475, -0.325])
    assert_task(out, 2, [0.0] * 4)
    assert_task(out, 3, [0.7])
    # singleton: baseline 0 but reward_mean is the group mean
    assert metrics["group_advantages/group_baseline/min"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["group_advantages/reward_mean/max"] == pytest.approx(0.7, abs=1e-6)


def test_opmd_logavgexp():
    out, _ = run_fn("opmd", opmd_baseline="logavgexp", tau=0.5)
    # task 0 has rewards [1, 0, 0, 1]: equal rewards get equal scores
    assert_task(out, 0, [0.28310955, -0.71689045, -0.71689045, 0.28310955])
    assert_task(out, 1, [-0.02720642, -0.32720643, 0.37279356, -0.42720643])
    assert_task(out, 3, [0.7])


def test_asymre():
    out, metrics = run_fn("asymre")
    assert_task(out, 0, [0.6, -0.4, -0.4, 0.6])
    assert_task(out, 2, [0.1] * 4)
    assert_task(out, 3, [0.7])
    # the singleton reports b − shift = 0 + 0.1 (reference quirk)
    assert metrics["group_advantages/reward_mean/min"] == pytest.approx(0.1, abs=1e-6)
    assert metrics["group_advantages/group_baseline/min"] == pytest.approx(0.0, abs=1e-6)


def test_reinforce_raw_reward():
    out, metrics = run_fn("reinforce")
    for (task, run), exp in by_run(out).items():
        assert_advantage(exp, GROUP_REWARDS[task][run])
    assert metrics["group_advantages/reward_mean/max"] == pytest.approx(0.7, abs=1e-6)
    assert metrics["group_advantages/reward_mean/min"] == pytest.approx(0.3, abs=1e-6)
    assert metrics["group_advantages/reward_mean/mean"] == pytest.approx((0.5 + 0.425 + 0.3 + 0.7) / 4, abs=1e-6)


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
    assert metrics["group_advantages/reward_std/max"] == pytest.approx(0.5, abs=1e-6)


@pytest.mark.parametrize("std_normalize", [False, True])
def test_rec_singleton_uses_zero_mean_unit_std(std_normalize):
    out, metrics = run_fn("rec", exps=make_group_experiences(tasks=(3,)), std_normalize=std_normalize, drop="balance")
    assert_advantage(out[0], 0.7 / (1 + 1e-6) if std_normalize else 0.7)
    assert metrics == {
        "group_advantages/drop_balance/mean": 0.0, "group_advantages/drop_balance/max": 0.0,
        "group_advantages/drop_balance/min": 0.0, "group_advantages/reward_mean/mean": 0.0,
        "group_advantages/reward_mean/max": 0.0, "group_advantages/reward_mean/min": 0.0,
        "group_advantages/reward_std/mean": 1.0, "group_advantages/reward_std/max": 1.0,
        "group_advantages/reward_std/min": 1.0,
    }


def test_rec_drop_balance_drops_exactly_n_minus_p_negatives():
    rewards = [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]  # mean 1/6: P = 1, N = 5 -> drop 4
    exps = [Experience(eid=EID(task=0, run=i), tokens=torch.arange(4), prompt_length=1, reward=r)
            for i, r in enumerate(rewards)]
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
    assert metrics["group_advantages/drop_balance/mean"] == pytest.approx(4 / 6, abs=1e-6)
    assert metrics["group_advantages/reward_mean/mean"] == pytest.approx(0.5, abs=1e-6)
    assert len(out) == 6  # dropped members stay, with advantage 0


def test_rec_drop_balance_keeps_all_when_positives_dominate():
    out, metrics = run_fn("rec", exps=make_group_experiences(tasks=(2,)), drop="balance")
    assert_task(out, 2, [0.0] * 4)
    assert metrics["group_advantages/drop_balance/max"] == 0.0


# --------------------------------------------------------------------------------------------- step-wise GRPO


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
    expected = {"group_advantages/reward_mean/mean": 0.2333333, "group_advantages/reward_std/mean": 0.5,
                "experience_count": 11, "filtered_count": 0, "skipped_group_ratio": 0.0}
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, abs=1e-6), key


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
        (2, 0, 0), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1),
        (0, 0, 0), (0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 2, 1), (0, 2, 2),
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
    assert metrics["skipped_group_ratio"] == pytest.approx(0.6666667, abs=1e-6)
    assert metrics["group_advantages/reward_std/max"] == pytest.approx(1.0, abs=1e-6)  # skipped ones reported


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


# --------------------------------------------------------------------------------------------- shared behaviour


GROUP_KEYS = ["grpo", "step_wise_grpo", "opmd", "asymre", "reinforce", "rec"]


@pytest.mark.parametrize("key", GROUP_KEYS)
def test_empty_input(key):
    out, metrics = ADVANTAGE_FN.get(key)()([])
    assert out == []
    # grpo always reports filtered_count (spec §12.3 step 5)
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


@pytest.mark.parametrize("key, kwargs, match", [
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
])
def test_bad_args(key, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ADVANTAGE_FN.get(key)(**kwargs)


@pytest.mark.parametrize("key", GROUP_KEYS)
def test_default_args_match_spec(key):
    expected = {
        "grpo": {"epsilon": 1e-6, "std_threshold": None, "duplicate_experiences": False, "rank_penalty": None,
                 "std_cal_level": "group"},
        "step_wise_grpo": {"epsilon": 1e-6, "enable_step_norm": False, "std_threshold": None, "std_cal_level": "group"},
        "opmd": {"opmd_baseline": "mean", "tau": 1.0},
        "asymre": {"baseline_shift": -0.1},
        "reinforce": {},
        "rec": {"epsilon": 1e-6, "std_normalize": False, "drop": None},
    }[key]
    assert ADVANTAGE_FN.get(key).default_args() == expected
    assert ADVANTAGE_FN.get(key).compute_in_trainer() is False

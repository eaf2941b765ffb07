"""What the advantage base classes give every function (``advantage/advantage_fn.py``): the properties a
function declares to a trainer."""

from __future__ import annotations

import pytest

from trinity_trl.algorithms.advantage import ADVANTAGE_FN

CLASS_FLAGS = (
    "needs_old_logprobs",
    "needs_teacher_logprobs",
    "needs_values",
    "needs_reward_baselines",
    "whitens",
    "step_wise",
    "needs_step_states",
)
DECLARED = {
    # key: the CLASS_FLAGS that are true (all others false)
    "grpo": set(), "opmd": set(), "asymre": set(), "reinforce": set(), "rec": set(),
    "step_wise_grpo": {"step_wise"},
    "gigpo": {"step_wise", "needs_step_states"},
    "ppo": {"needs_values", "whitens"},
    "reinforceplusplus": {"whitens"},
    "rloo": set(), "grpo_verl": set(), "opmd_verl": set(), "asymre_verl": set(),
    "remax": {"needs_reward_baselines"},
    "on_policy_distill": {"needs_old_logprobs", "needs_teacher_logprobs"},
}  # fmt: skip


def test_every_registered_function_has_declared_flags():
    assert sorted(DECLARED) == sorted(ADVANTAGE_FN.names())


@pytest.mark.parametrize("key", sorted(DECLARED))
def test_class_flags(key):
    cls = ADVANTAGE_FN.get(key)
    instance = cls(**cls.default_args())
    for flag in CLASS_FLAGS:
        assert getattr(cls, flag) is getattr(instance, flag) is (flag in DECLARED[key]), flag


GROUP_PROPERTIES = [
    # key, args, needs_logprobs, refills_filtered_groups
    ("grpo", {}, False, False),
    ("grpo", {"rank_penalty": 0.2}, True, False),
    ("grpo", {"rank_penalty": 0.0}, True, False),  # 0.0 is set: the ranks are still computed
    ("grpo", {"std_threshold": 0.0}, False, False),
    ("grpo", {"duplicate_experiences": True}, False, False),  # nothing is filtered without a threshold
    ("grpo", {"duplicate_experiences": True, "std_threshold": 0.0}, False, True),
    ("step_wise_grpo", {}, False, False),
    ("step_wise_grpo", {"std_threshold": 0.0}, False, False),
    ("gigpo", {}, False, False),
    ("opmd", {}, False, False),
    ("asymre", {}, False, False),
    ("reinforce", {}, False, False),
    ("rec", {"drop": "balance"}, False, False),
]


@pytest.mark.parametrize("key, args, needs_logprobs, refills", GROUP_PROPERTIES)
def test_group_operator_properties(key, args, needs_logprobs, refills):
    fn = ADVANTAGE_FN.get(key)(**args)
    assert fn.needs_logprobs is needs_logprobs
    assert fn.refills_filtered_groups is refills

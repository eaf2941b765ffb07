"""The reward functions of an asynchronous trainer as one picklable reward function for TRL's vLLM worker."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..training import checks
from ..training.advantages import weighted_rewards
from .worker import GroupScorer


class RewardSum:
    """The reward functions as ONE picklable reward function for TRL's vLLM worker (which runs them in a spawned
    process and sums them with weight 1): their weighted sum by `trinity_trl.training.advantages.weighted_rewards`,
    the rule of every other path (docs/guarantees.md#bad-rewards): a function's ``None``, NaN or infinite value leaves
    that function out of the completion's sum, and a completion no function scored (or whose sum is not finite) is
    ``None``, which TRL's z-score leaves out of its group (TRL's own sum would let one ``inf`` turn the group's
    advantages into NaN). Each function is called as `trinity_trl.training.checks.checked_reward_func` calls it, so a
    failure or a malformed result is named."""

    __name__ = "reward"

    def __init__(self, funcs: list[Any], weights: list[float]):
        self.funcs, self.weights = funcs, weights

    def __call__(self, *, prompts: list, completions: list, completion_ids: list, **columns: Any) -> list[float | None]:
        from ..training.grpo_seams import get_callable_name

        names = [get_callable_name(f) for f in self.funcs]
        weights = torch.tensor(self.weights, dtype=torch.float32)
        # the checked wrappers are closures (not picklable): built in the process that scores
        checked = [checks.checked_reward_func(f, n) for f, n in zip(self.funcs, names)]
        per_func = GroupScorer(checked, names, weights, None).rewards(prompts, completions, completion_ids, columns)
        total = weighted_rewards(per_func, weights)
        return [value if math.isfinite(value) else None for value in total.tolist()]

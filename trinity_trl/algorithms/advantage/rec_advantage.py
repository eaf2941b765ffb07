"""REC advantage — key ``rec`` (docs/algorithms/advantages.md#rec).

``R_i − μ`` (optionally divided by the population std) over the kept members of a group. With
``drop="balance"``, when negatives (``R < mean``) outnumber positives, random negatives are dropped
(advantage 0) until both counts match. A singleton group — which makes the reference fail — uses
``μ = 0, σ = 1`` and drops nothing.
"""

from __future__ import annotations

import random

import torch

from ..experience import Experience, gather_metrics, group_by
from .advantage_fn import ADVANTAGE_FN, GroupAdvantageFn
from .grpo import check_choice, check_positive, experience_rewards

REC_DROPS = (None, "balance")


@ADVANTAGE_FN.register("rec")
class RECGroupAdvantage(GroupAdvantageFn):
    """Args:
        epsilon: added to σ when ``std_normalize`` (> 0).
        std_normalize: divide by the population (÷|K|) std of the kept rewards.
        drop: ``None`` or ``"balance"``; the dropped negatives are drawn uniformly without
            replacement from ``rng``, else Python's ``random`` module (seed it for reproducibility).

    Dropped members stay in the output with advantage 0. Metrics per group: ``drop_balance``
    (``(N − P)/|G|`` when dropping, else 0), ``reward_mean = μ``, ``reward_std = σ``.
    """

    draws_random = True  # the dropped negatives

    def __init__(self, epsilon: float = 1e-6, std_normalize: bool = False, drop: str | None = None):
        self.epsilon = check_positive("epsilon", epsilon)
        self.std_normalize = bool(std_normalize)
        self.drop = check_choice("drop", drop, REC_DROPS)

    def group_scores(
        self, rewards: torch.Tensor, rng: random.Random | None = None
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Scores ``(|G|,)`` (0 for dropped members) and the group metrics."""
        kept = torch.ones(len(rewards), dtype=torch.bool)
        drop_balance = 0.0
        if len(rewards) > 1:
            positive = rewards >= rewards.mean()
            num_pos = int(positive.sum())
            num_neg = len(rewards) - num_pos
            if self.drop == "balance" and num_neg > num_pos:
                negatives = (~positive).nonzero().flatten().tolist()
                kept[(rng or random).sample(negatives, num_neg - num_pos)] = False
                drop_balance = (num_neg - num_pos) / len(rewards)
        kept_rewards = rewards[kept]
        if len(kept_rewards) <= 1:
            mean, std = torch.tensor(0.0), torch.tensor(1.0)
        else:
            mean, std = kept_rewards.mean(), kept_rewards.std(correction=0)
        scores = rewards - mean
        if self.std_normalize:
            scores = scores / (std + self.epsilon)
        scores = torch.where(kept, scores, torch.zeros_like(scores))
        return scores, {"drop_balance": drop_balance, "reward_mean": mean.item(), "reward_std": std.item()}

    def process(
        self, experiences: list[Experience], rng: random.Random | None = None
    ) -> tuple[list[Experience], dict[str, float]]:
        output: list[Experience] = []
        metric_list: list[dict[str, float]] = []
        for group in group_by(experiences, "task").values():
            scores, metrics = self.group_scores(experience_rewards(group), rng)
            for exp, score in zip(group, scores.tolist()):
                exp.set_advantage(score)
            metric_list.append(metrics)
            output.extend(group)
        return output, gather_metrics(metric_list, "group_advantages")

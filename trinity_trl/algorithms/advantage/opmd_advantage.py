"""OPMD advantages: the group operator ``opmd`` (docs/algorithms/advantages.md#opmd) and the batch ``opmd_verl``
(docs/algorithms/advantages.md#batch-functions).

``score = reward − b`` with the group baseline ``b``:

* ``"mean"``: ``b = mean(R)``;
* ``"logavgexp"``: ``b = τ·(logsumexp(R/τ) − ln|G|)`` (a soft maximum that tends to the mean as
  τ → ∞ and to ``max(R)`` as τ → 0);
* a singleton group: ``b = 0``.

The reference treats *any* string other than ``"mean"`` as ``"logavgexp"``; here any other value
is a ``ValueError``, so a typo cannot silently switch the baseline.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..experience import Experience, gather_metrics, group_by
from .advantage_fn import ADVANTAGE_FN, BatchAdvantageFn, GroupAdvantageFn
from .grpo import (
    check_choice,
    check_positive,
    experience_rewards,
    group_mean,
    row_groups,
    row_scores,
    write_row_advantages,
)

OPMD_BASELINES = ("mean", "logavgexp")


def opmd_group_baseline(rewards: torch.Tensor, opmd_baseline: str, tau: float) -> torch.Tensor:
    """Baseline (0-d, float32) of one group's rewards ``(|G|,)``."""
    if len(rewards) == 1:
        return torch.tensor(0.0)
    if opmd_baseline == "mean":
        return rewards.mean()
    return tau * (torch.logsumexp(rewards / tau, dim=-1) - math.log(len(rewards)))


class _OPMDArgs:
    """Arguments shared by ``opmd`` and ``opmd_verl``."""

    def __init__(self, opmd_baseline: str = "mean", tau: float = 1.0):
        self.opmd_baseline = check_choice("opmd_baseline", opmd_baseline, OPMD_BASELINES)
        self.tau = check_positive("tau", tau)


@ADVANTAGE_FN.register("opmd")
class OPMDGroupAdvantage(_OPMDArgs, GroupAdvantageFn):
    """Args: ``opmd_baseline`` (``"mean"`` or ``"logavgexp"``), ``tau`` (> 0, logavgexp temperature).

    Metrics per group: ``group_baseline = b`` and ``reward_mean = mean(R)`` (also for singletons).
    """

    def process(self, experiences: list[Experience]) -> tuple[list[Experience], dict[str, float]]:
        output: list[Experience] = []
        metric_list: list[dict[str, float]] = []
        for group in group_by(experiences, "task").values():
            rewards = experience_rewards(group)
            baseline = opmd_group_baseline(rewards, self.opmd_baseline, self.tau)
            for exp, score in zip(group, (rewards - baseline).tolist()):
                exp.set_advantage(score)
            metric_list.append({"group_baseline": baseline.item(), "reward_mean": rewards.mean().item()})
            output.extend(group)
        return output, gather_metrics(metric_list, "group_advantages")


@ADVANTAGE_FN.register("opmd_verl")
class OPMDBatchAdvantage(_OPMDArgs, BatchAdvantageFn):
    """``(S − b_g)·M`` on padded tensors; same arguments and baselines as ``opmd``. Metrics ``{}``.

    Reads ``token_level_rewards (B, T)``, ``response_mask (B, T)``, ``uid``; writes
    ``advantages = returns (B, T)`` float32.
    """

    @torch.no_grad()
    def process(self, batch: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float]]:
        scores, mask = row_scores(batch)
        index, counts = row_groups(batch, scores.shape[0], scores.device)
        if self.opmd_baseline == "mean":
            baseline = group_mean(scores, index, counts)
        else:
            scaled = scores / self.tau
            group_max = torch.full(counts.shape, -math.inf, dtype=scaled.dtype, device=scaled.device)
            group_max = group_max.scatter_reduce(0, index, scaled, reduce="amax")
            # shift by the group max for a stable logsumexp; an all -inf group keeps shift 0 (as torch.logsumexp)
            group_max = torch.where(torch.isfinite(group_max), group_max, torch.zeros_like(group_max))
            sum_exp = torch.zeros_like(group_max).index_add_(0, index, torch.exp(scaled - group_max[index]))
            baseline = self.tau * (torch.log(sum_exp) + group_max - torch.log(counts.to(scaled.dtype)))
        baseline = torch.where(counts == 1, torch.zeros_like(baseline), baseline)
        write_row_advantages(batch, scores - baseline[index], mask)
        return batch, {}

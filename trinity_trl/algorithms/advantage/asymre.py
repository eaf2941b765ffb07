"""AsymRE advantages: the group operator ``asymre`` (docs/algorithms/advantages.md#asymre) and the batch ``asymre_verl``
(docs/algorithms/advantages.md#batch-functions).

``score = reward − b`` with ``b = mean(R) + baseline_shift`` (``b = 0`` for a singleton). A
negative shift lowers the baseline, so more samples are reinforced than penalised.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..experience import Experience, gather_metrics, group_by
from .advantage_fn import ADVANTAGE_FN, BatchAdvantageFn, GroupAdvantageFn
from .grpo import experience_rewards, group_mean, row_groups, row_scores, write_row_advantages


def _check_shift(baseline_shift: Any) -> float:
    if (
        isinstance(baseline_shift, bool)
        or not isinstance(baseline_shift, (int, float))
        or not math.isfinite(baseline_shift)
    ):
        raise ValueError(f"baseline_shift must be a finite number, got {baseline_shift!r}")
    return float(baseline_shift)


@ADVANTAGE_FN.register("asymre")
class AsymREGroupAdvantage(GroupAdvantageFn):
    """Arg: ``baseline_shift`` (default −0.1).

    Metrics per group: ``group_baseline = b`` and ``reward_mean = b − baseline_shift``. For a
    singleton that is ``−baseline_shift`` (0.1 by default), not the reward: the reference applies
    the formula even though ``b`` was forced to 0, and so does this port.
    """

    def __init__(self, baseline_shift: float = -0.1):
        self.baseline_shift = _check_shift(baseline_shift)

    def process(self, experiences: list[Experience]) -> tuple[list[Experience], dict[str, float]]:
        output: list[Experience] = []
        metric_list: list[dict[str, float]] = []
        for group in group_by(experiences, "task").values():
            rewards = experience_rewards(group)
            baseline = torch.tensor(0.0) if len(group) == 1 else rewards.mean() + self.baseline_shift
            for exp, score in zip(group, (rewards - baseline).tolist()):
                exp.set_advantage(score)
            metric_list.append(
                {"group_baseline": baseline.item(), "reward_mean": baseline.item() - self.baseline_shift}
            )
            output.extend(group)
        return output, gather_metrics(metric_list, "group_advantages")


@ADVANTAGE_FN.register("asymre_verl")
class AsymREBatchAdvantage(BatchAdvantageFn):
    """``(S − b_g)·M`` on padded tensors, ``b_g = mean_g(S) + baseline_shift`` (0 for singletons).

    Reads ``token_level_rewards (B, T)``, ``response_mask (B, T)``, ``uid``; writes
    ``advantages = returns (B, T)`` float32. Metrics ``{}``.
    """

    def __init__(self, baseline_shift: float = -0.1):
        self.baseline_shift = _check_shift(baseline_shift)

    @torch.no_grad()
    def process(self, batch: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float]]:
        scores, mask = row_scores(batch)
        index, counts = row_groups(batch, scores.shape[0], scores.device)
        baseline = group_mean(scores, index, counts) + self.baseline_shift
        baseline = torch.where(counts == 1, torch.zeros_like(baseline), baseline)
        write_row_advantages(batch, scores - baseline[index], mask)
        return batch, {}

"""RLOO (REINFORCE leave-one-out) — key ``rloo`` (docs/algorithms/advantages.md#batch-functions, batch function).

Each row's baseline is the mean score of the *other* rows of its group:
``A_b = S_b − mean_{j≠b} S_j = n/(n−1)·(S_b − mean_g S)``. A singleton group has no other row,
so its advantage is the raw score.
"""

from __future__ import annotations

from typing import Any

import torch

from .advantage_fn import ADVANTAGE_FN, BatchAdvantageFn
from .grpo import group_mean, row_groups, row_scores, write_row_advantages


@ADVANTAGE_FN.register("rloo")
class RLOOAdvantage(BatchAdvantageFn):
    """No arguments. Reads ``token_level_rewards (B, T)``, ``response_mask (B, T)``, ``uid``;
    writes ``advantages = returns = A[b]·M[b, t]`` ``(B, T)`` float32. Metrics ``{}``."""

    @torch.no_grad()
    def process(self, batch: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float]]:
        scores, mask = row_scores(batch)
        index, counts = row_groups(batch, scores.shape[0], scores.device)
        mean = group_mean(scores, index, counts)
        n = counts.to(scores.dtype)[index]
        # same operation order as the reference: S·n/(n−1) − mean·n/(n−1)
        leave_one_out = scores * n / (n - 1) - mean[index] * n / (n - 1)
        write_row_advantages(batch, torch.where(n > 1, leave_one_out, scores), mask)
        return batch, {}

"""ReMax — key ``remax`` (docs/algorithms/advantages.md#batch-functions, batch function; needs greedy-rollout
``reward_baselines``).

``returns[b, t] = Σ_{t' ≥ t} r[b, t']·M[b, t']`` and ``advantages = returns − baseline[b]·M``.
Rewards at masked positions are replaced by 0 before the sum (the reference multiplies by ``M``,
which lets a NaN there through as NaN·0 = NaN; with finite values both agree).
"""

from __future__ import annotations

from typing import Any

import torch

from ..masked import masked_fill_invalid
from .advantage_fn import ADVANTAGE_FN, BatchAdvantageFn, batch_get


@ADVANTAGE_FN.register("remax")
class ReMaxAdvantage(BatchAdvantageFn):
    """No arguments. Reads ``token_level_rewards (B, T)``, ``response_mask (B, T)`` and
    ``reward_baselines (B,)`` (the reward of a greedy rollout of the same prompt). Writes
    ``advantages`` and ``returns`` ``(B, T)`` in the reward dtype. Metrics ``{}``."""

    needs_reward_baselines = True

    @torch.no_grad()
    def process(self, batch: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float]]:
        rewards = batch_get(batch, "token_level_rewards")
        mask = batch_get(batch, "action_mask")
        baselines = torch.as_tensor(batch_get(batch, "reward_baselines"), device=rewards.device)
        if rewards.shape != mask.shape or rewards.dim() != 2:
            raise ValueError(
                f"token_level_rewards {tuple(rewards.shape)} and response_mask {tuple(mask.shape)} must both be (B, T)"
            )
        if baselines.shape != rewards.shape[:1]:
            raise ValueError(f"reward_baselines must have shape ({rewards.shape[0]},), got {tuple(baselines.shape)}")
        weight = mask.to(rewards.dtype)
        masked_rewards = masked_fill_invalid(rewards, mask) * weight
        returns = masked_rewards.flip(-1).cumsum(-1).flip(-1)
        batch["returns"] = returns
        batch["advantages"] = returns - baselines.to(rewards.dtype).unsqueeze(-1) * weight
        return batch, {}

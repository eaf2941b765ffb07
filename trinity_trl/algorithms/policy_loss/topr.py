"""TOPR: tapered off-policy REINFORCE (docs/algorithms/policy-losses.md#topr)."""

from __future__ import annotations

from typing import Any

import torch

from ..masked import check_loss_agg_mode, masked_mean
from .base import POLICY_LOSS_FN, PolicyLossFn


@POLICY_LOSS_FN.register("topr")
class TOPRPolicyLossFn(PolicyLossFn):
    """TOPR: per-token loss ``−sg(α)·A·ℓ`` with ``α = clamp(r, 0, 1)`` where ``A <= advantage_threshold``
    and ``α = 1`` elsewhere, ``r = exp(ℓ − ℓo)`` (not clamped).

    Good samples get plain SFT-like REINFORCE; bad ones are down-weighted by their (truncated)
    ratio, so pushing down already-unlikely tokens stays bounded. ``advantages`` plays the role of
    the paper's reward ``R(x, y)`` (group-baseline advantages can be passed instead).

    Shapes: ``logprob``, ``old_logprob``, ``advantages``, ``action_mask``: ``(B, T)``.
    Metrics: ``topr_loss``, ``avg_alpha = MMEAN(α)``, ``avg_ratio = MMEAN(r)``.
    """

    def __init__(self, backend: str = "trl", advantage_threshold: float = 0.0, loss_agg_mode: str = "token-mean"):
        super().__init__(backend)
        self.advantage_threshold = float(advantage_threshold)
        self.loss_agg_mode = check_loss_agg_mode(loss_agg_mode)

    @property
    def linear_in_advantage(self) -> bool:
        # which branch a token takes depends on A itself unless the threshold is 0 (sign only)
        return self.advantage_threshold == 0.0

    def token_losses(self, logprob, old_logprob, action_mask, advantages, **_):
        mask, adv = action_mask, advantages
        ratio = torch.exp(logprob - old_logprob).detach()
        alpha = torch.where(adv <= self.advantage_threshold, torch.clamp(ratio, 0.0, 1.0), torch.ones_like(ratio))
        metrics: dict[str, Any] = {"avg_alpha": masked_mean(alpha, mask), "avg_ratio": masked_mean(ratio, mask)}
        return -alpha * adv * logprob, metrics

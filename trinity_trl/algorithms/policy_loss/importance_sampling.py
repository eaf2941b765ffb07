"""Plain importance-sampled policy gradient, no clipping (docs/algorithms/policy-losses.md#importance-sampling;
on-policy distillation)."""

from __future__ import annotations

from typing import Any

import torch

from ..masked import masked_mean
from .base import POLICY_LOSS_FN, AggregatedLossFn


@POLICY_LOSS_FN.register("importance_sampling")
class ImportanceSamplingLossFn(AggregatedLossFn):
    """Per-token loss ``−A·r`` with ``r = exp(clamp(ℓ − ℓo, −20, 20))``; the gradient is ``−A·r·∇ℓ``.

    No clip: meant for on-policy distillation, where ``A`` is a teacher signal and the ratio
    only corrects for the small lag between behaviour and current policy.

    Shapes: ``logprob``, ``old_logprob``, ``advantages``, ``action_mask``: ``(B, T)``.
    Metrics: ``pg_loss``, ``ratio/mean = MMEAN(r)``, ``approx_kl = MMEAN(−δ)`` (clamped δ).
    """

    loss_metric = "pg_loss"

    def token_losses(self, logprob, old_logprob, action_mask, advantages, **_):
        mask = action_mask
        log_ratio = torch.clamp(logprob - old_logprob, -20.0, 20.0)
        ratio = torch.exp(log_ratio)
        metrics: dict[str, Any] = {
            "ratio/mean": masked_mean(ratio.detach(), mask),
            "approx_kl": masked_mean(-log_ratio.detach(), mask),
        }
        return -advantages * ratio, metrics

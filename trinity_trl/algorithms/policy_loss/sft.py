"""SFT losses: plain, importance-weighted and φ-weighted (docs/algorithms/policy-losses.md#sft)."""

from __future__ import annotations

import math

import torch

from ..masked import check_loss_agg_mode
from .base import POLICY_LOSS_FN, AggregatedLossFn, PolicyLossFn


def phi_function(token_prob: torch.Tensor) -> torch.Tensor:
    """CHORD's φ weight ``p·(1−p)``: small for tokens the model finds very unlikely or already certain."""
    return token_prob * (1.0 - token_prob)


@POLICY_LOSS_FN.register("sft")
class SFTLossFn(AggregatedLossFn):
    """Negative log-likelihood ``AGG(−ℓ, m)``.

    Shapes: ``logprob``, ``action_mask``: ``(B, T)``. Metric: ``sft_loss``.
    """

    inputs = ("action_mask",)

    def token_losses(self, logprob, **_):
        return -logprob, {}


@POLICY_LOSS_FN.register("sft_is")
class SFTISLossFn(AggregatedLossFn):
    """NLL weighted by the detached token probability: ``AGG(−ℓ·sg(exp(ℓ)), m)``.

    Tokens the model already finds unlikely are down-weighted (gradient ``−p·∇ℓ = −∇p``).
    Shapes: ``logprob``, ``action_mask``: ``(B, T)``. Metric: ``sft_is_loss``.
    """

    inputs = ("action_mask",)

    def token_losses(self, logprob, **_):
        return -logprob * torch.exp(logprob).detach(), {}


@POLICY_LOSS_FN.register("sft_phi")
class SFTPhiLossFn(PolicyLossFn):
    """CHORD-φ SFT: ``AGG(−ℓ'·sg(φ(p)), m)`` with ``p = exp(ℓ)`` and ``φ(p) = p·(1−p)``.

    ``ℓ' = min(ℓ, ln cutoff_prob)`` when ``cutoff_prob < 1``, else ``ℓ``: tokens with
    ``p > cutoff_prob`` then add a constant and no gradient. ``φ`` is taken from the unclamped
    ``ℓ``. ``0 < cutoff_prob <= 1`` (0 would need ``ln 0``).

    Shapes: ``logprob``, ``action_mask``: ``(B, T)``. Metric: ``sft_phi_loss``.
    """

    inputs = ("action_mask",)

    def __init__(self, backend: str = "trl", loss_agg_mode: str = "token-mean", cutoff_prob: float = 1.0):
        super().__init__(backend)
        self.loss_agg_mode = check_loss_agg_mode(loss_agg_mode)
        if not 0.0 < cutoff_prob <= 1.0:
            raise ValueError(f"sft_phi: cutoff_prob must be in (0, 1], got {cutoff_prob}")
        self.cutoff_prob = float(cutoff_prob)

    def token_losses(self, logprob, **_):
        weight = phi_function(torch.exp(logprob)).detach()
        clipped = logprob
        if self.cutoff_prob < 1.0:
            clipped = torch.clamp(logprob, max=math.log(self.cutoff_prob))
        return -clipped * weight, {}

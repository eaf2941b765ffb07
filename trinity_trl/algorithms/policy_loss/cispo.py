"""CISPO: REINFORCE weighted by a clipped, detached importance ratio (docs/algorithms/policy-losses.md#cispo)."""

from __future__ import annotations

from typing import Any

import torch

from ..masked import check_loss_agg_mode, masked_mean
from .base import POLICY_LOSS_FN, PolicyLossFn


def _check_range(owner: str, name: str, value: float, upper: float | None) -> float:
    value = float(value)
    if value < 0 or (upper is not None and value > upper):
        allowed = f"in [0, {upper}]" if upper is not None else ">= 0"
        raise ValueError(f"{owner}: {name} must be {allowed}, got {value}")
    return value


@POLICY_LOSS_FN.register("cispo")
class CISPOPolicyLossFn(PolicyLossFn):
    """CISPO (MiniMax-M1): per-token loss ``−A · sg(w) · sg(M) · ℓ``.

    ``w = clamp(r, 1 − clip_range_low, 1 + clip_range_high)`` with ``r = exp(ℓ − ℓo)`` (not
    clamped); the default range is ``[0, 1.28]``. The weight never drops a token: every token keeps
    the gradient ``−A·w·M·∇ℓ``. Only the optional ``enable_mask_clip`` zeroes tokens (``M = 0``)
    whose ratio left ``[1 − mask_clip_range_low, 1 + mask_clip_range_high]`` in the direction the
    advantage pushes (``r`` too high with ``A > 0``, too low with ``A < 0``).

    Shapes: ``logprob``, ``old_logprob``, ``advantages``, ``action_mask``: ``(B, T)``.

    Relation to TRL ``loss_type="cispo"`` (``−sg(min(r, epsilon_high))·A·ℓ``, ``dapo`` aggregation):
    TRL's ``epsilon_high`` is an absolute cap, so TRL equals this loss with the defaults when
    ``epsilon_high = 1 + clip_range_high`` and the micro-batch is the whole accumulation window.

    Metrics: ``cispo_loss``, ``ppo_kl = MMEAN(ℓo − ℓ)``, ``unmasked_frac = MMEAN(M)`` and ``pg_clipfrac =
    MMEAN([w ≠ r])``, the share of tokens whose weight the range capped (either bound, whatever the advantage).
    """

    def __init__(
        self,
        backend: str = "trl",
        clip_range_low: float = 1.0,
        clip_range_high: float = 0.28,
        enable_mask_clip: bool = False,
        mask_clip_range_low: float = 1.0,
        mask_clip_range_high: float = 0.28,
        loss_agg_mode: str = "token-mean",
    ):
        super().__init__(backend)
        # a ratio is positive, so a lower bound below 0 (range_low > 1) would mean nothing
        self.clip_range_low = _check_range("cispo", "clip_range_low", clip_range_low, 1.0)
        self.clip_range_high = _check_range("cispo", "clip_range_high", clip_range_high, None)
        self.enable_mask_clip = bool(enable_mask_clip)
        self.mask_clip_range_low = _check_range("cispo", "mask_clip_range_low", mask_clip_range_low, 1.0)
        self.mask_clip_range_high = _check_range("cispo", "mask_clip_range_high", mask_clip_range_high, None)
        self.loss_agg_mode = check_loss_agg_mode(loss_agg_mode)

    def token_losses(self, logprob, old_logprob, action_mask, advantages, **_):
        mask, adv = action_mask, advantages
        log_ratio = logprob - old_logprob
        ratio = torch.exp(log_ratio).detach()
        weight = torch.clamp(ratio, 1.0 - self.clip_range_low, 1.0 + self.clip_range_high)
        keep = torch.ones_like(ratio)
        if self.enable_mask_clip:
            too_high = (ratio > 1.0 + self.mask_clip_range_high) & (adv > 0)
            too_low = (ratio < 1.0 - self.mask_clip_range_low) & (adv < 0)
            keep = (~(too_high | too_low)).to(ratio.dtype)
        metrics: dict[str, Any] = {
            "ppo_kl": masked_mean(-log_ratio, mask),
            "unmasked_frac": masked_mean(keep, mask),
            "pg_clipfrac": masked_mean((weight != ratio).to(ratio.dtype), mask),
        }
        return -adv * weight * keep * logprob, metrics

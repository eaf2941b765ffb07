"""PPO-clip policy loss with dual clip, sequence masking and IS truncation (docs/algorithms/policy-losses.md#ppo)."""

from __future__ import annotations

from typing import Any

import torch

from ..masked import check_loss_agg_mode, masked_mean
from .base import POLICY_LOSS_FN, PolicyLossFn


def resolve_clip_range(
    clip_range: float | None, clip_range_low: float | None, clip_range_high: float | None, owner: str
) -> tuple[float, float]:
    """``(εl, εh)``: the specific bound if given, else ``clip_range``; both must resolve."""
    low = clip_range_low if clip_range_low is not None else clip_range
    high = clip_range_high if clip_range_high is not None else clip_range
    if low is None or high is None:
        raise ValueError(
            f"{owner}: the clip range is unresolved (low={low}, high={high}); set clip_range, "
            "or both clip_range_low and clip_range_high"
        )
    if low < 0 or high < 0:
        raise ValueError(f"{owner}: clip ranges must be >= 0, got low={low}, high={high}")
    return float(low), float(high)


@POLICY_LOSS_FN.register("ppo")
class PPOPolicyLossFn(PolicyLossFn):
    """PPO-clip: ``max(−A·r, −A·clip(r, 1−εl, 1+εh))``, dual-clipped at ``−A·clip_ratio_c`` for A<0.

    Shapes: ``logprob``, ``old_logprob``, ``advantages``, ``action_mask``: ``(B, T)``.
    Options: off-policy sequence masking (DeepSeek-V3.2), importance-ratio truncation for
    positive / negative advantages (applied after the dual clip), and ``fallback_to_policy_gradient``
    (ratio 1 with the REINFORCE gradient).

    The constructor has no default clip range (an unresolved bound raises ``ValueError``); a
    preset uses ``clip_range=0.2`` (docs/algorithms/policy-losses.md#ppo).
    """

    preset_defaults = {"clip_range": 0.2}
    # TRL's epsilon / epsilon_high are the same relative bounds (1 - epsilon, 1 + epsilon_high)
    trl_config_fields = {"epsilon": "clip_range", "epsilon_high": "clip_range_high"}
    loss_metric = "pg_loss"

    def __init__(
        self,
        backend: str = "trl",
        clip_range: float | None = None,
        clip_range_low: float | None = None,
        clip_range_high: float | None = None,
        clip_ratio_c: float = 3.0,
        loss_agg_mode: str = "token-mean",
        enable_sequence_masking: bool = False,
        delta_sequence_masking: float = 0.1,
        fallback_to_policy_gradient: bool = False,
        truncate_adv_pos_is: bool = False,
        truncate_adv_neg_is: bool = False,
        truncate_is_range_low: float = 0.0,
        truncate_is_range_high: float = 2.0,
    ):
        super().__init__(backend)
        self.clip_range_low, self.clip_range_high = resolve_clip_range(
            clip_range, clip_range_low, clip_range_high, "ppo"
        )
        if not clip_ratio_c > 1.0:
            raise ValueError(f"ppo: clip_ratio_c must be > 1.0, got {clip_ratio_c}")
        self.clip_ratio_c = float(clip_ratio_c)
        self.loss_agg_mode = check_loss_agg_mode(loss_agg_mode)
        self.enable_sequence_masking = bool(enable_sequence_masking)
        self.delta_sequence_masking = float(delta_sequence_masking)
        self.fallback_to_policy_gradient = bool(fallback_to_policy_gradient)
        self.truncate_adv_pos_is = bool(truncate_adv_pos_is)
        self.truncate_adv_neg_is = bool(truncate_adv_neg_is)
        self.truncate_is_range_low = float(truncate_is_range_low)
        self.truncate_is_range_high = float(truncate_is_range_high)
        if self.truncate_adv_pos_is and not 0.0 <= self.truncate_is_range_low < 1.0 - self.clip_range_low:
            raise ValueError(
                "ppo: truncate_adv_pos_is needs 0 <= truncate_is_range_low < 1 - clip_range_low "
                f"= {1.0 - self.clip_range_low}, got {self.truncate_is_range_low}"
            )
        if self.truncate_adv_neg_is and not self.truncate_is_range_high > 1.0 + self.clip_range_high:
            raise ValueError(
                "ppo: truncate_adv_neg_is needs truncate_is_range_high > 1 + clip_range_high "
                f"= {1.0 + self.clip_range_high}, got {self.truncate_is_range_high}"
            )
        if (
            self.truncate_adv_pos_is
            and self.truncate_adv_neg_is
            and not self.truncate_is_range_high > self.truncate_is_range_low
        ):
            raise ValueError("ppo: truncate_is_range_high must be > truncate_is_range_low")

    @property
    def sequence_level(self) -> bool:
        return self.enable_sequence_masking  # the mask uses each row's mean log-ratio

    def token_losses(self, logprob, old_logprob, action_mask, advantages, raw_advantages, **_):
        mask, adv = action_mask, advantages
        if self.fallback_to_policy_gradient:
            log_ratio = logprob - logprob.detach()
        else:
            log_ratio = logprob - old_logprob
        log_ratio = torch.clamp(log_ratio, -20.0, 20.0)
        ratio = torch.exp(log_ratio)

        loss_unclipped = -adv * ratio
        loss_clipped = -adv * torch.clamp(ratio, 1.0 - self.clip_range_low, 1.0 + self.clip_range_high)
        loss_max = torch.maximum(loss_unclipped, loss_clipped)
        loss_dual = -adv * self.clip_ratio_c
        token_loss = torch.where(adv < 0, torch.minimum(loss_max, loss_dual), loss_max)

        metrics: dict[str, Any] = {
            "pg_clipfrac": masked_mean((loss_clipped > loss_unclipped).to(logprob.dtype), mask),
            "pg_clipfrac_lower": masked_mean(((loss_max > loss_dual) & (adv < 0)).to(logprob.dtype), mask),
            "ppo_kl": masked_mean(-log_ratio, mask),
        }

        if self.truncate_adv_pos_is:
            loss_pos = -adv * self.truncate_is_range_low
            metrics["is_truncate_frac_pos"] = masked_mean(((loss_pos < token_loss) & (adv > 0)).to(logprob.dtype), mask)
            token_loss = torch.where(adv > 0, torch.minimum(token_loss, loss_pos), token_loss)
        if self.truncate_adv_neg_is:
            loss_neg = -adv * self.truncate_is_range_high
            metrics["is_truncate_frac_neg"] = masked_mean(((loss_neg < token_loss) & (adv < 0)).to(logprob.dtype), mask)
            token_loss = torch.where(adv < 0, torch.minimum(token_loss, loss_neg), token_loss)

        if self.enable_sequence_masking:
            weight = mask.to(logprob.dtype)
            seq_kl = (-log_ratio.detach() * weight).sum(-1) / (weight.sum(-1) + 1e-10)
            # reference behaviour: the dropped-token count uses the raw advantages on all B×T positions
            drop = (raw_advantages < 0) & (seq_kl.unsqueeze(-1) > self.delta_sequence_masking)
            token_loss = token_loss * (~drop).to(token_loss.dtype)
            metrics["seq_mask/masked_tokens"] = drop.to(logprob.dtype).sum() / (weight.sum() + 1e-10)
            metrics["seq_mask/mean_sequence_kl"] = seq_kl.mean()

        return token_loss, metrics

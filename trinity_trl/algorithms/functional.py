"""verl-compatible functional entry points.

``agg_loss`` lives in `masked` and ``kl_penalty`` in `kl`; this module adds
``compute_policy_loss`` with verl's signature and return tuple.
"""

from __future__ import annotations

import torch

from .kl import kl_penalty
from .masked import agg_loss
from .policy_loss.ppo import PPOPolicyLossFn

__all__ = ["agg_loss", "compute_policy_loss", "kl_penalty"]


def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float | None = None,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dual-clip PPO loss (docs/algorithms/policy-losses.md#ppo) with verl's signature.

    All tensors are ``(B, T)``. Returns ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``:
    the loss carries gradient, the three metrics are detached 0-d tensors.
    """
    fn = PPOPolicyLossFn(
        clip_range=cliprange,
        clip_range_low=cliprange_low,
        clip_range_high=cliprange_high,
        clip_ratio_c=clip_ratio_c,
        loss_agg_mode=loss_agg_mode,
    )
    loss, metrics = fn.evaluate(
        logprob=log_prob, old_logprob=old_log_prob, advantages=advantages, action_mask=response_mask
    )
    return loss, metrics["pg_clipfrac"], metrics["ppo_kl"], metrics["pg_clipfrac_lower"]

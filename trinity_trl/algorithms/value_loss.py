"""Clipped value (critic) loss of the ``ppo`` preset (docs/algorithms/entropy.md#critic-loss, verl's
``compute_value_loss``).

``vf_loss = ½ · AGG(max((V − R)², (clamp(V, V_old − c, V_old + c) − R)²), m, mode)``

with ``V`` the critic's current values, ``V_old`` the values the critic gave when the batch was
generated, ``R`` the GAE returns (docs/algorithms/advantages.md#batch-functions) and ``c = cliprange_value``. The clip
keeps one update from moving a value more than ``c`` away from its old estimate, the same trust region
PPO's ratio clip gives the policy. All tensors are ``(B, T)`` over response tokens.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .masked import agg_loss, check_loss_agg_mode, masked_fill_invalid, masked_mean


def check_cliprange_value(cliprange_value: float) -> float:
    if not (isinstance(cliprange_value, (int, float)) and cliprange_value > 0 and not math.isnan(cliprange_value)):
        raise ValueError(f"cliprange_value must be a number > 0 (math.inf: no clipping), got {cliprange_value!r}")
    return float(cliprange_value)


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, Any]]:
    """PPO's clipped value loss and its metrics.

    Args:
        values: ``(B, T)`` current critic values ``V`` (differentiable).
        old_values: ``(B, T)`` critic values ``V_old`` at generation time (data, no gradient).
        returns: ``(B, T)`` value targets ``R`` (data, no gradient).
        response_mask: ``(B, T)`` bool or float; 1 = train on this token.
        cliprange_value: ``c > 0``; ``math.inf`` disables the clip.
        loss_agg_mode: aggregation of the per-token loss (docs/algorithms/aggregation.md#loss-agg-mode).

    Returns:
        ``(loss, metrics)``: a 0-d tensor and detached 0-d tensors ``vf_loss`` (the loss),
        ``vf_clipfrac`` (``MMEAN([clipped > unclipped], m)``, strict) and ``vpred_mean``
        (``MMEAN(V, m)``). Positions with a zero mask are replaced by 0 first, so NaN/inf there
        reaches neither the loss nor the gradient; an empty mask gives a loss of 0 with zero gradient
        (``seq-mean-*`` modes need at least one row).
    """
    check_loss_agg_mode(loss_agg_mode)
    c = check_cliprange_value(cliprange_value)
    if not (values.shape == old_values.shape == returns.shape == response_mask.shape) or values.dim() != 2:
        raise ValueError(
            f"values {tuple(values.shape)}, old_values {tuple(old_values.shape)}, returns {tuple(returns.shape)} and "
            f"response_mask {tuple(response_mask.shape)} must all be (B, T)"
        )
    values = masked_fill_invalid(values, response_mask)
    old_values = masked_fill_invalid(old_values.detach().to(values.dtype), response_mask)
    returns = masked_fill_invalid(returns.detach().to(values.dtype), response_mask)
    clipped_values = torch.maximum(torch.minimum(values, old_values + c), old_values - c)
    unclipped_loss = (values - returns) ** 2
    clipped_loss = (clipped_values - returns) ** 2
    loss = 0.5 * agg_loss(torch.maximum(unclipped_loss, clipped_loss), response_mask, loss_agg_mode)
    metrics = {
        "vf_loss": loss.detach(),
        "vf_clipfrac": masked_mean((clipped_loss > unclipped_loss).to(values.dtype), response_mask).detach(),
        "vpred_mean": masked_mean(values, response_mask).detach(),
    }
    return loss, metrics

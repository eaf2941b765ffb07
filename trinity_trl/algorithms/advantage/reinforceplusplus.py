"""REINFORCE++ — key ``reinforceplusplus`` (docs/algorithms/advantages.md#batch-functions, batch function), and the
discounted right-to-left scan that GAE shares.

``G[:, t] = r[:, t] + γ·G[:, t+1]`` over the **full** width with no reset at padding (Trinity keeps
this older verl form; newer verl resets at masked positions). Consequence, kept on purpose: a
reward (or a NaN) in a padded position flows into every earlier position of its row, and a NaN
there then reaches every row through the global whitening.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..masked import masked_whiten
from .advantage_fn import ADVANTAGE_FN, BatchAdvantageFn, batch_get


def check_discount(name: str, value: Any) -> float:
    """``float(value)`` if it is a number in ``[0, 1]``, else ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or not 0 <= value <= 1:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)


@torch.no_grad()
def discounted_reverse_cumsum(x: torch.Tensor, discount: float) -> torch.Tensor:
    """``y[..., t] = Σ_{k ≥ 0} discount**k · x[..., t + k]`` along the last dim (no reset anywhere).

    ``x``: ``(..., T)``; returns a new tensor of the same shape and dtype, without gradient
    (advantages and returns are data). A log-depth doubling scan: after the pass with shift
    ``s``, ``y[t]`` holds the discounted sum of ``x[t : t + 2s]``, so ``⌈log2 T⌉`` whole-tensor
    passes replace a Python loop over ``T`` tokens. Each pass reads one buffer and writes the
    other (never in place, which would read already-updated entries). Runs in float64 (float32 on
    MPS, which has no float64) so the re-associated sum stays well below float32 rounding.
    A NaN/inf at position ``t`` reaches every ``t' ≤ t`` even for ``discount = 0`` (0·NaN = NaN),
    exactly as the step-by-step loop of the reference.
    """
    work_dtype = torch.float32 if x.device.type == "mps" else torch.float64
    y = x.to(work_dtype, copy=True)
    z = torch.empty_like(y)
    width = y.shape[-1]
    shift = 1
    while shift < width:
        torch.add(y[..., : width - shift], y[..., shift:], alpha=discount**shift, out=z[..., : width - shift])
        z[..., width - shift :] = y[..., width - shift :]
        y, z = z, y
        shift *= 2
    return y.to(x.dtype)


@ADVANTAGE_FN.register("reinforceplusplus")
class REINFORCEPlusPlusAdvantage(BatchAdvantageFn):
    """Discounted return, whitened over the whole batch.

    Args: ``gamma`` in ``[0, 1]`` (default 1.0).

    Reads ``token_level_rewards (B, T)`` and ``response_mask (B, T)``. Writes
    ``advantages = WHITEN(G, M)·M`` and ``returns = G`` (unmasked), both ``(B, T)`` in the reward
    dtype. Metrics ``{}``. Fewer than 2 unmasked tokens in the batch is a ``ValueError`` (MVAR).
    """

    whitens = True

    def __init__(self, gamma: float = 1.0):
        self.gamma = check_discount("gamma", gamma)

    @torch.no_grad()
    def process(self, batch: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float]]:
        rewards = batch_get(batch, "token_level_rewards")
        mask = batch_get(batch, "action_mask")
        if rewards.shape != mask.shape or rewards.dim() != 2:
            raise ValueError(
                f"token_level_rewards {tuple(rewards.shape)} and response_mask {tuple(mask.shape)} must both be (B, T)"
            )
        returns = discounted_reverse_cumsum(rewards, self.gamma)
        batch["advantages"] = masked_whiten(returns, mask) * mask.to(returns.dtype)
        batch["returns"] = returns
        return batch, {}

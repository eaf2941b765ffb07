"""PPO's GAE — key ``ppo`` (docs/algorithms/advantages.md#batch-functions, batch function; needs a critic's ``values``).

``δ_t = r_t + γ·V_{t+1} − V_t`` (``V_T = 0``), ``Â_t = δ_t + γλ·Â_{t+1}``, ``returns = Â + V``,
``advantages = WHITEN(Â, M)`` — not re-multiplied by ``M``, as in the reference.

Padded positions are not skipped (this version of the reference): the value just after the last
valid token enters that token's ``δ``, and ``Â`` accumulates over the full width, so a NaN in a
padded reward or value reaches the valid tokens of its row (and, through the whitening, every row).
"""

from __future__ import annotations

from typing import Any

import torch

from ..masked import masked_whiten
from .advantage_fn import ADVANTAGE_FN, BatchAdvantageFn, batch_get_token_level
from .reinforceplusplus import check_discount, discounted_reverse_cumsum


@ADVANTAGE_FN.register("ppo")
class GAEAdvantage(BatchAdvantageFn):
    """Generalised advantage estimation.

    Args: ``gamma`` and ``lam`` in ``[0, 1]`` (defaults 1.0).

    Reads ``token_level_rewards (B, T)``, ``values (B, T)``, ``response_mask (B, T)``. Writes
    ``advantages (B, T)`` (whitened) and ``returns (B, T)`` in the reward dtype. Metrics ``{}``.
    """

    needs_values = True
    whitens = True

    def __init__(self, gamma: float = 1.0, lam: float = 1.0):
        self.gamma = check_discount("gamma", gamma)
        self.lam = check_discount("lam", lam)

    @torch.no_grad()
    def process(self, batch: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float]]:
        rewards, values, mask = batch_get_token_level(batch, "token_level_rewards", "values")
        values = values.to(rewards.dtype)
        next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], dim=-1)
        # δ in the reward dtype with the reference's operation order; the scan itself runs in float64
        deltas = rewards + self.gamma * next_values - values
        advantages = discounted_reverse_cumsum(deltas, self.gamma * self.lam)
        batch["returns"] = advantages + values
        batch["advantages"] = masked_whiten(advantages, mask)
        return batch, {}

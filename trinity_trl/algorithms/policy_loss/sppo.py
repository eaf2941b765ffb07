"""sPPO: REINFORCE on the log-ratio, restricted to tokens whose ratio is in a trust region
(docs/algorithms/policy-losses.md#sppo)."""

from __future__ import annotations

from typing import Any

import torch

from ..masked import check_loss_agg_mode, masked_mean
from .base import POLICY_LOSS_FN, PolicyLossFn


@POLICY_LOSS_FN.register("sppo")
class SPPOPolicyLossFn(PolicyLossFn):
    """sPPO: per-token loss ``−A·(ℓ − ℓo)·in`` with ``in = [1/(1+ε) <= r <= 1+ε]`` (both inclusive).

    ``r = sg(exp(ℓ − ℓo))``. The range is symmetric in log space (``|log r| <= log(1+ε)``). The
    gradient is ``−A·∇ℓ`` on in-range tokens and exactly 0 outside, whatever the advantage sign.

    Shapes: ``logprob``, ``old_logprob``, ``advantages``, ``action_mask``: ``(B, T)``.
    Metrics: ``pg_clipfrac = MMEAN(1 − in)``, ``pg_loss``.
    """

    loss_metric = "pg_loss"

    def __init__(self, backend: str = "trl", epsilon: float = 0.3, loss_agg_mode: str = "token-mean"):
        super().__init__(backend)
        if not epsilon > 0:
            raise ValueError(f"sppo: epsilon must be > 0, got {epsilon}")
        self.epsilon = float(epsilon)
        self.loss_agg_mode = check_loss_agg_mode(loss_agg_mode)

    def token_losses(self, logprob, old_logprob, action_mask, advantages, **_):
        mask, adv = action_mask, advantages
        log_ratio = logprob - old_logprob
        ratio = torch.exp(log_ratio).detach()
        in_range = ((ratio >= 1.0 / (1.0 + self.epsilon)) & (ratio <= 1.0 + self.epsilon)).to(logprob.dtype)
        metrics: dict[str, Any] = {"pg_clipfrac": masked_mean(1.0 - in_range, mask)}
        return -adv * log_ratio * in_range, metrics

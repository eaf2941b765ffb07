"""OPMD policy loss: REINFORCE scaled by ``1/(1+τ)`` (docs/algorithms/policy-losses.md#opmd)."""

from __future__ import annotations

import math

from ..masked import check_loss_agg_mode
from .base import POLICY_LOSS_FN, PolicyLossFn


@POLICY_LOSS_FN.register("opmd")
class OPMDPolicyLossFn(PolicyLossFn):
    """OPMD: ``AGG(−A·ℓ, m) / (1 + tau)``; the behaviour log-probs are not used.

    ``tau`` is OPMD's mirror-descent regularisation strength; in this loss it only shrinks the
    step by ``1/(1+τ)``, so it must be ``>= 0`` (a negative value would enlarge or flip the step).

    Shapes: ``logprob``, ``advantages``, ``action_mask``: ``(B, T)``.
    Metric: ``opmd_loss`` (after the division).
    """

    inputs = ("action_mask", "advantages")

    def __init__(self, backend: str = "trl", tau: float = 1.0, loss_agg_mode: str = "token-mean"):
        super().__init__(backend)
        if not (math.isfinite(tau) and tau >= 0):
            raise ValueError(f"opmd: tau must be a finite number >= 0, got {tau}")
        self.tau = float(tau)
        self.loss_agg_mode = check_loss_agg_mode(loss_agg_mode)

    def token_losses(self, logprob, advantages, **_):
        return -advantages * logprob / (1.0 + self.tau), {}

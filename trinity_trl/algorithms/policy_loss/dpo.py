"""DPO on interleaved chosen/rejected rows (docs/algorithms/policy-losses.md#dpo)."""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F

from ..masked import masked_sum
from .base import POLICY_LOSS_FN, PolicyLossFn


@POLICY_LOSS_FN.register("dpo")
class DPOLossFn(PolicyLossFn):
    """DPO sigmoid loss with label smoothing, one scalar per micro-batch.

    Rows are interleaved pairs: even rows (0, 2, ...) are *chosen*, odd rows (1, 3, ...) *rejected*.
    As in the reference, each side is a single sum over **all** rows of its parity::

        C = MSUM(ℓ[even], m[even]) − MSUM(ℓr[even], m[even]),   R = (same over odd rows),   h = C − R
        loss = −(1 − ls)·logsigmoid(β·h) − ls·logsigmoid(−β·h)

    This equals per-pair DPO only when the micro-batch holds exactly one pair, so a trainer
    must keep pairs adjacent and in order (no batch balancing).

    Shapes: ``logprob``, ``ref_logprob``, ``action_mask``: ``(B, T)`` with ``B`` even and > 0.

    Args:
        beta: inverse temperature of the implicit reward, ``> 0``.
        label_smoothing: probability that a preference label is flipped (conservative DPO),
            ``0 <= label_smoothing < 0.5``; at 0.5 the loss no longer prefers either side.
        allow_odd_rows: accept an odd ``B`` (the last chosen row then has no rejected partner).
            Off by default because an unpaired row means the pairing is broken; the reference
            implementation accepts it, and its test data (docs/algorithms/reference-values.md#policy-loss-values, ``B =
            5``) needs it.

    Metrics: ``chosen_reward = β·C``, ``rejected_reward = β·R``, ``accuracy_mean = [C > R]``,
    ``dpo_loss``.
    """

    inputs = ("ref_logprob", "action_mask")
    # one call is one chosen/rejected pair's loss, which TrinityDPOTrainer averages over the pairs: no token
    # aggregation, and no rollout trainer can run it (``pairwise``)
    weighs_samples_itself = True
    pairwise = True

    def __init__(
        self, backend: str = "trl", beta: float = 0.1, label_smoothing: float = 0.0, *, allow_odd_rows: bool = False
    ):
        super().__init__(backend)
        if not beta > 0:
            raise ValueError(f"dpo: beta must be > 0, got {beta}")
        if not 0.0 <= label_smoothing < 0.5:
            raise ValueError(f"dpo: label_smoothing must be in [0, 0.5), got {label_smoothing}")
        self.beta = float(beta)
        self.label_smoothing = float(label_smoothing)
        self.allow_odd_rows = bool(allow_odd_rows)

    def compute(self, logprob, ref_logprob, action_mask, **_):
        n_rows = logprob.shape[0]
        if n_rows < 2 or (n_rows % 2 and not self.allow_odd_rows):
            raise ValueError(
                f"dpo: needs an even number (>= 2) of rows, chosen/rejected pairs interleaved, got {n_rows} "
                "(allow_odd_rows=True accepts an unpaired last chosen row, as the reference does)"
            )
        even, odd = slice(0, None, 2), slice(1, None, 2)
        # two separate sums (not one sum of ℓ − ℓr) so the rounding matches the reference
        chosen = masked_sum(logprob[even], action_mask[even]) - masked_sum(ref_logprob[even], action_mask[even])
        rejected = masked_sum(logprob[odd], action_mask[odd]) - masked_sum(ref_logprob[odd], action_mask[odd])
        logits = self.beta * (chosen - rejected)
        loss = -(1.0 - self.label_smoothing) * F.logsigmoid(logits) - self.label_smoothing * F.logsigmoid(-logits)
        metrics: dict[str, Any] = {
            "chosen_reward": self.beta * chosen.detach(),
            "rejected_reward": self.beta * rejected.detach(),
            "accuracy_mean": (chosen > rejected).to(logprob.dtype),
            "dpo_loss": loss.detach(),
        }
        return loss, metrics

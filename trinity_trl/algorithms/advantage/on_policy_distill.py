"""On-policy distillation — key ``on_policy_distill`` (docs/algorithms/advantages.md#batch-functions, batch function).

The per-token advantage is the teacher's log-ratio over the behaviour policy,
``kl_coef·(ℓτ − ℓo)·M``: minus the per-token reverse KL sample, so tokens the teacher likes
more than the student are reinforced. Masked positions are replaced by 0 before the
difference, so NaN/inf log-probs in padding cannot leak (the reference's plain ``·M`` would).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..masked import masked_fill_invalid
from .advantage_fn import ADVANTAGE_FN, BatchAdvantageFn, batch_get_token_level


@ADVANTAGE_FN.register("on_policy_distill")
class OnPolicyDistillAdvantage(BatchAdvantageFn):
    """Args: ``kl_coef`` (finite number, default 1.0).

    Reads ``teacher_logprobs (B, T)``, the behaviour log-probs ``old_logprob`` (also
    ``old_log_probs`` / ``old_per_token_logps``) ``(B, T)`` and ``response_mask (B, T)``. Writes
    ``advantages = returns (B, T)``. Metrics, with ``k_b = Σ_t (ℓo − ℓτ)·M`` (nats):
    ``kl/mean``, ``kl/std`` (unbiased; 0.0 for one row) and ``advantages/mean = mean_b Σ_t A``.
    """

    needs_old_logprobs = True
    needs_teacher_logprobs = True

    def __init__(self, kl_coef: float = 1.0):
        if isinstance(kl_coef, bool) or not isinstance(kl_coef, (int, float)) or not math.isfinite(kl_coef):
            raise ValueError(f"kl_coef must be a finite number, got {kl_coef!r}")
        self.kl_coef = float(kl_coef)

    @torch.no_grad()
    def process(self, batch: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float]]:
        teacher, old, mask = batch_get_token_level(batch, "teacher_logprobs", "old_logprob")
        reverse_kl = (masked_fill_invalid(old, mask) - masked_fill_invalid(teacher, mask)) * mask.to(old.dtype)
        advantages = -self.kl_coef * reverse_kl
        batch["advantages"] = advantages
        batch["returns"] = advantages.clone()
        kl_sum = reverse_kl.sum(dim=-1)
        metrics = {
            "kl/mean": kl_sum.mean().item(),
            "kl/std": kl_sum.std().item() if len(kl_sum) > 1 else 0.0,
            "advantages/mean": advantages.sum(dim=-1).mean().item(),
        }
        return batch, metrics

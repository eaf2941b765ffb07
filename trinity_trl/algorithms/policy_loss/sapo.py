"""SAPO: a soft, temperature-controlled gate instead of a hard clip (docs/algorithms/policy-losses.md#sapo,
docs/algorithms/trl-differences.md#sapo)."""

from __future__ import annotations

from typing import Any

import torch

from ..masked import check_loss_agg_mode, masked_mean
from .base import POLICY_LOSS_FN, PolicyLossFn

SAPO_FORMS = ("trinity", "paper")


@POLICY_LOSS_FN.register("sapo")
class SAPOPolicyLossFn(PolicyLossFn):
    """SAPO with the soft gate ``f(r) = sigmoid(τ·(r − 1)) · 4/τ``, ``r = exp(ℓ − ℓo)`` (not clamped).

    ``τ = tau_pos`` where ``A > 0`` and ``tau_neg`` elsewhere (``A == 0`` uses ``tau_neg``). Negative
    advantages get the larger temperature, i.e. a gate that decays faster off-policy, hence
    ``tau_neg >= tau_pos`` is required.

    Two forms (``form``):

    * ``"trinity"`` (default, docs/algorithms/policy-losses.md#sapo, Trinity-RFT's reference): per-token loss ``−A ·
    sg(f(r)) · ℓ``.
      The gradient is ``−A·f(r)·∇ℓ``, which is *not* the derivative of ``−A·f(r)``: at ``r = 1`` it is
      ``−(2/τ)·A·∇ℓ``, i.e. ``2/τ`` times the on-policy policy gradient (twice for ``τ = 1``), and it
      does not vanish for large ``r``. The loss value is ``−A·f·ℓ``, not ``−A·f``.
    * ``"paper"`` (the SAPO paper, and TRL ``loss_type="sapo"``): per-token loss ``−A · f(r)`` with
      ``r`` differentiable, so the gradient is ``−A·4σ(1−σ)·r·∇ℓ``, equal to ``−A·∇ℓ`` at ``r = 1``
      and vanishing far off-policy. TRL aggregates it with ``seq-mean-token-mean``.

    Shapes: ``logprob``, ``old_logprob``, ``advantages``, ``action_mask``: ``(B, T)``.

    Metrics (both forms): ``sapo_loss``, ``ppo_kl = MMEAN(ℓo − ℓ)``, ``avg_soft_gate = MMEAN(f)``,
    ``avg_ratio = MMEAN(r)``, ``pos_adv_frac = MMEAN([A > 0])``.
    """

    # TRL's SAPO temperatures are the gate temperatures for positive / negative advantages
    trl_config_fields = {"sapo_temperature_pos": "tau_pos", "sapo_temperature_neg": "tau_neg"}

    def __init__(
        self,
        backend: str = "trl",
        tau_pos: float = 1.0,
        tau_neg: float = 1.05,
        loss_agg_mode: str = "token-mean",
        *,
        form: str = "trinity",
    ):
        super().__init__(backend)
        self.tau_pos, self.tau_neg = float(tau_pos), float(tau_neg)
        if not (self.tau_pos > 0 and self.tau_neg > 0):
            raise ValueError(f"sapo: tau_pos and tau_neg must be > 0, got tau_pos={tau_pos}, tau_neg={tau_neg}")
        if self.tau_neg < self.tau_pos:
            raise ValueError(f"sapo: tau_neg must be >= tau_pos, got tau_neg={tau_neg} < tau_pos={tau_pos}")
        self.loss_agg_mode = check_loss_agg_mode(loss_agg_mode)
        if form not in SAPO_FORMS:
            raise ValueError(f"sapo: unknown form {form!r}; allowed: {', '.join(SAPO_FORMS)}")
        self.form = form

    def token_losses(self, logprob, old_logprob, action_mask, advantages, **_):
        mask, adv = action_mask, advantages
        log_ratio = logprob - old_logprob
        ratio = torch.exp(log_ratio)
        positive = adv > 0
        # built in ℓ's dtype: python-float branches of torch.where would round τ to float32 first
        tau = torch.where(positive, *(logprob.new_tensor(t) for t in (self.tau_pos, self.tau_neg)))
        # the two forms round like their references (Trinity: ·(4/τ), TRL: ·4/τ), so values match bit for bit
        if self.form == "trinity":
            gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
            token_loss = -adv * gate.detach() * logprob
        else:
            gate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
            token_loss = -adv * gate
        metrics: dict[str, Any] = {
            "ppo_kl": masked_mean(-log_ratio.detach(), mask),
            "avg_soft_gate": masked_mean(gate.detach(), mask),
            "avg_ratio": masked_mean(ratio.detach(), mask),
            "pos_adv_frac": masked_mean(positive.to(logprob.dtype), mask),
        }
        return token_loss, metrics

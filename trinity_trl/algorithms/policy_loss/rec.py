"""REC family: clipped / weighted / regularised REINFORCE on sampled tokens (docs/algorithms/policy-losses.md#rec)."""

from __future__ import annotations

import torch

from ..masked import check_loss_agg_mode, masked_mean
from .base import POLICY_LOSS_FN, PolicyLossFn

REC_CLIP_MODES = ("none", "one-side", "gspo-one-side", "two-side", "ring")
REC_WEIGHTS = ("none", "importance_sampling", "truncated_importance_sampling", "gspo_importance_sampling", "advantage")
REC_REGULARIZERS = ("none", "k2", "forward-kl")


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"rec: unknown {name} {value!r}; allowed: {', '.join(allowed)}")
    return value


@POLICY_LOSS_FN.register("rec")
class RECPolicyLossFn(PolicyLossFn):
    """REC: ``−A'·ℓ·in`` with a detached ratio that only selects tokens (``in``) or weights ``A'``.

    Shapes: ``logprob``, ``old_logprob``, ``advantages``, ``action_mask``: ``(B, T)``.
    ``clip_mode`` picks which tokens are trained (by token ratio ``r``, or by the sequence ratio
    ``g`` for ``gspo-one-side``), ``weight`` rescales the advantage, ``regularizer`` adds a
    forward-KL (``−coef·ℓ``) or a k2 (``coef·(ℓ−ℓo)²``) term. ``gspo-one-side`` always aggregates
    with ``seq-mean-token-mean``.

    A preset uses wider primes than the constructor: ``epsilon_low_prime=0.6, epsilon_high_prime=2``
    (docs/algorithms/policy-losses.md#rec; the constructor's are 0.4 / 0.4).
    """

    preset_defaults = {"epsilon_low_prime": 0.6, "epsilon_high_prime": 2}
    loss_metric = "pg_loss"

    def __init__(
        self,
        backend: str = "trl",
        epsilon_low: float = 0.2,
        epsilon_high: float = 0.2,
        epsilon_low_prime: float = 0.4,
        epsilon_high_prime: float = 0.4,
        clip_mode: str = "none",
        weight: str = "none",
        regularizer: str = "none",
        regularizer_coef: float = 0.0,
        temp: float = 1.0,
        loss_agg_mode: str = "token-mean",
        fix_opd_advantage: bool = False,
    ):
        super().__init__(backend)
        for name, value, low_le_one in (
            ("epsilon_low", epsilon_low, True),
            ("epsilon_high", epsilon_high, False),
            ("epsilon_low_prime", epsilon_low_prime, True),
            ("epsilon_high_prime", epsilon_high_prime, False),
        ):
            if not (value > 0 and (value <= 1 or not low_le_one)):
                allowed = "0 < value <= 1" if low_le_one else "value > 0"
                raise ValueError(f"rec: {name} must satisfy {allowed}, got {value}")
        self.epsilon_low, self.epsilon_high = float(epsilon_low), float(epsilon_high)
        self.epsilon_low_prime, self.epsilon_high_prime = float(epsilon_low_prime), float(epsilon_high_prime)
        self.clip_mode = _choice("clip_mode", clip_mode, REC_CLIP_MODES)
        self.weight = _choice("weight", weight, REC_WEIGHTS)
        self.regularizer = _choice("regularizer", regularizer, REC_REGULARIZERS)
        if weight == "gspo_importance_sampling" and clip_mode != "gspo-one-side":
            raise ValueError(
                f"rec: weight 'gspo_importance_sampling' needs clip_mode 'gspo-one-side', got {clip_mode!r}"
            )
        if not regularizer_coef >= 0:
            raise ValueError(f"rec: regularizer_coef must be >= 0, got {regularizer_coef}")
        if not temp > 0:
            raise ValueError(f"rec: temp must be > 0, got {temp}")
        self.regularizer_coef, self.temp = float(regularizer_coef), float(temp)
        self.loss_agg_mode = check_loss_agg_mode(loss_agg_mode)
        self.fix_opd_advantage = bool(fix_opd_advantage)

    @property
    def linear_in_advantage(self) -> bool:
        # exp(A/temp) weights, a regulariser that does not scale with A, and the distillation
        # re-centring (adds a term independent of A) break linearity
        return self.weight != "advantage" and self.regularizer == "none" and not self.fix_opd_advantage

    @property
    def sequence_level(self) -> bool:
        return self.clip_mode == "gspo-one-side" or self.weight == "gspo_importance_sampling"

    @property
    def effective_loss_agg_mode(self):
        # gspo-one-side is a sequence-level objective: always seq-mean-token-mean (a trainer passes an
        # aggregation built for that mode)
        return "seq-mean-token-mean" if self.clip_mode == "gspo-one-side" else self.loss_agg_mode

    def token_losses(self, logprob, old_logprob, action_mask, advantages, **_):
        mask, adv = action_mask, advantages
        low, high = 1.0 - self.epsilon_low, 1.0 + self.epsilon_high
        ratio = torch.exp(logprob - old_logprob).detach()
        seq_ratio = None
        if self.clip_mode == "gspo-one-side":
            seq_ratio = torch.exp(masked_mean((logprob - old_logprob).detach(), mask, dim=-1)).unsqueeze(-1)

        if self.clip_mode == "none":
            in_range = torch.ones_like(ratio, dtype=torch.bool)
        elif self.clip_mode == "two-side":
            in_range = (ratio >= low) & (ratio <= high)
        elif self.clip_mode == "one-side":
            in_range = ((ratio <= high) & (adv >= 0)) | ((adv <= 0) & (ratio >= low))
        elif self.clip_mode == "gspo-one-side":
            in_range = ((seq_ratio <= high) & (adv >= 0)) | ((seq_ratio >= low) & (adv <= 0))
        else:  # ring: the trust region plus the far tails where the update moves the ratio back
            in_range = (
                ((ratio >= low) & (ratio <= high))
                | ((adv >= 0) & (ratio <= 1.0 - self.epsilon_low_prime))
                | ((adv <= 0) & (ratio >= 1.0 + self.epsilon_high_prime))
            )

        if self.weight == "none":
            weighted_adv = adv
        elif self.weight == "importance_sampling":
            weighted_adv = adv * ratio
        elif self.weight == "truncated_importance_sampling":
            weighted_adv = adv * torch.clamp(ratio, 1.0 - self.epsilon_low_prime, 1.0 + self.epsilon_high_prime)
        elif self.weight == "gspo_importance_sampling":
            weighted_adv = adv * seq_ratio
        else:
            weighted_adv = adv * torch.exp(adv / self.temp)
        if self.fix_opd_advantage:
            # distillation advantages (ℓτ − ℓo) were built against the behaviour policy: re-centre on the current one
            weighted_adv = weighted_adv + old_logprob - logprob.detach()

        token_loss = -weighted_adv * logprob * in_range.to(logprob.dtype)
        if self.regularizer == "forward-kl":
            token_loss = token_loss - self.regularizer_coef * logprob
        elif self.regularizer == "k2":
            token_loss = token_loss + self.regularizer_coef * (logprob - old_logprob) ** 2

        return token_loss, {"pg_clipfrac": masked_mean((~in_range).to(logprob.dtype), mask)}

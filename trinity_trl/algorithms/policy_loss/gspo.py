"""GSPO, token form: one clipped sequence-level ratio with a per-token gradient
(docs/algorithms/policy-losses.md#gspo)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from ..masked import check_loss_agg_mode, masked_mean
from .base import POLICY_LOSS_FN, PolicyLossFn
from .ppo import resolve_clip_range

logger = logging.getLogger(__name__)


@POLICY_LOSS_FN.register("gspo")
class GSPOPolicyLossFn(PolicyLossFn):
    """GSPO-token: ``max(−A·s, −A·clip(s, 1−εl, 1+εh))`` with ``s = exp(ρ_b)`` for every token.

    ``ρ_b = MMEAN_row(ℓ − ℓo, m)[b]`` is the mean log-ratio of row ``b`` (not clamped). The ratio
    is built as ``exp(ℓ − sg(ℓ) + sg(ρ_b))``: its value is the sequence ratio, its gradient is
    ``s·∇ℓ[b,t]`` per token, so token-varying advantages still act per token. There is no dual clip.

    Shapes: ``logprob``, ``old_logprob``, ``advantages``, ``action_mask``: ``(B, T)``.

    The constructor has no default clip range (an unresolved bound raises ``ValueError``);
    a preset (``preset_defaults``) gives the paper's tiny range 3e-4 / 4e-4. GSPO is defined with
    ``seq-mean-token-mean``; another mode is allowed but logged as a warning.

    Metrics: ``pg_clipfrac``, ``ppo_kl`` (token-level, ``MMEAN(ℓo − ℓ)``), ``pg_loss`` and
    ``ppo_kl_seq`` (mean over rows of ``−ρ_b``).
    """

    preset_defaults = {"clip_range_low": 0.0003, "clip_range_high": 0.0004}
    # TRL's epsilon / epsilon_high are the same relative bounds (1 - epsilon, 1 + epsilon_high)
    trl_config_fields = {"epsilon": "clip_range", "epsilon_high": "clip_range_high"}
    loss_metric = "pg_loss"

    def __init__(
        self,
        backend: str = "trl",
        clip_range: float | None = None,
        clip_range_low: float | None = None,
        clip_range_high: float | None = None,
        loss_agg_mode: str = "seq-mean-token-mean",
    ):
        super().__init__(backend)
        self.clip_range_low, self.clip_range_high = resolve_clip_range(
            clip_range, clip_range_low, clip_range_high, "gspo"
        )
        self.loss_agg_mode = check_loss_agg_mode(loss_agg_mode)
        if self.loss_agg_mode != "seq-mean-token-mean":
            logger.warning(
                "gspo: loss_agg_mode=%r; GSPO is defined with 'seq-mean-token-mean' (sequence-level objective)",
                self.loss_agg_mode,
            )

    @classmethod
    def merged_args(cls, given: Mapping[str, Any]) -> dict[str, Any]:
        """A user's symmetric ``clip_range`` replaces the preset's bounds (`preset_defaults`), which the constructor
        would otherwise take over it."""
        args = super().merged_args(given)
        if "clip_range" not in given:
            return args
        return {name: value for name, value in args.items() if name in given or name not in cls.preset_defaults}

    @property
    def sequence_level(self) -> bool:
        return True  # one ratio per row

    def token_losses(self, logprob, old_logprob, action_mask, advantages, **_):
        mask, adv = action_mask, advantages
        log_ratio = logprob - old_logprob
        seq_log_ratio = masked_mean(log_ratio, mask, dim=-1)  # (B,)
        seq_ratio = torch.exp(logprob - logprob.detach() + seq_log_ratio.detach().unsqueeze(-1))

        loss_unclipped = -adv * seq_ratio
        loss_clipped = -adv * torch.clamp(seq_ratio, 1.0 - self.clip_range_low, 1.0 + self.clip_range_high)
        metrics: dict[str, Any] = {
            "pg_clipfrac": masked_mean((loss_clipped > loss_unclipped).to(logprob.dtype), mask),
            "ppo_kl": masked_mean(-log_ratio, mask),
            "ppo_kl_seq": (-seq_log_ratio).mean(),
        }
        return torch.maximum(loss_unclipped, loss_clipped), metrics

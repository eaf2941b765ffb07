"""CHORD (``mix_chord``): on-policy PPO + φ-weighted SFT with a scheduled weight μ (spec §9.3)."""

from __future__ import annotations

import math
from typing import Any

import torch

from .base import POLICY_LOSS_FN, PolicyLossFn
from .mix import ExpertMixLossFn, _unit_interval


def mu_schedule_function(
    global_step: int, mu_warmup_steps: int, mu_decay_steps: int, mu_peak: float, mu_valley: float
) -> float:
    """CHORD's μ at ``global_step``: linear warm-up 0→peak over ``mu_warmup_steps``, cosine decay
    peak→valley over the next ``mu_decay_steps``, then constant ``mu_valley``.

    ``global_step = mu_warmup_steps`` gives exactly ``mu_peak`` (when ``mu_decay_steps > 0``),
    ``global_step >= mu_warmup_steps + mu_decay_steps`` gives ``mu_valley``.
    """
    g, w, d = global_step, mu_warmup_steps, mu_decay_steps
    if g < w:
        return (g / w) * mu_peak
    if g >= w + d:
        return float(mu_valley)
    return (mu_peak - mu_valley) * 0.5 * (1.0 + math.cos(math.pi * (g - w) / d)) + mu_valley


@POLICY_LOSS_FN.register("mix_chord")
class CHORDPolicyLossFn(ExpertMixLossFn):
    """CHORD: ``(1−μ)·L_u + μ·L_e`` with μ from :func:`mu_schedule_function` at the batch's step.

    Shapes: ``logprob``, ``old_logprob``, ``advantages``, ``action_mask``: ``(B, T)``;
    ``expert_mask``: ``(B,)`` bool; ``step``: ``(B,)`` ints (tensor or sequence), all equal to the
    current global step. ``enable_phi_function`` picks ``sft_phi`` (φ-weighted) over plain ``sft``
    for the expert rows.
    """

    inputs = ("old_logprob", "action_mask", "advantages", "expert_mask", "step")

    def __init__(
        self,
        mu_warmup_steps: int = 0,
        mu_decay_steps: int = 0,
        mu_peak: float = 0.1,
        mu_valley: float = 0.1,
        enable_phi_function: bool = True,
        **kwargs: Any,
    ):
        if mu_warmup_steps < 0 or mu_decay_steps < 0:
            raise ValueError(
                f"mix_chord: mu_warmup_steps and mu_decay_steps must be >= 0, got {mu_warmup_steps}, {mu_decay_steps}"
            )
        self.mu_warmup_steps, self.mu_decay_steps = mu_warmup_steps, mu_decay_steps
        self.mu_peak = _unit_interval("mix_chord", "mu_peak", mu_peak)
        self.mu_valley = _unit_interval("mix_chord", "mu_valley", mu_valley)
        self.enable_phi_function = bool(enable_phi_function)
        super().__init__(**kwargs)

    @classmethod
    def default_args(cls) -> dict[str, Any]:
        return {
            "mu_warmup_steps": 0,
            "mu_decay_steps": 0,
            "mu_peak": 0.1,
            "mu_valley": 0.1,
            "clip_range": 0.2,
            "enable_phi_function": True,
            "loss_agg_mode": "token-mean",
        }

    def build_sft_loss_fn(self, loss_agg_mode: str) -> PolicyLossFn:
        if self.enable_phi_function:
            return POLICY_LOSS_FN.get("sft_phi")(loss_agg_mode=loss_agg_mode, cutoff_prob=1.0)
        return super().build_sft_loss_fn(loss_agg_mode)

    def global_step_of(self, step: Any, batch_size: int) -> int:
        """The one global step every row carries; rows from different steps are an error."""
        if isinstance(step, torch.Tensor):
            if step.dim() != 1:
                raise ValueError(f"mix_chord: step must have shape (B,), got {tuple(step.shape)}")
            values = step.tolist()
        elif isinstance(step, (list, tuple)):
            values = list(step)
        else:
            raise ValueError(f"mix_chord: step must be a (B,) tensor or a sequence of ints, got {type(step).__name__}")
        if len(values) != batch_size:
            raise ValueError(f"mix_chord: step must have one entry per row ({batch_size}), got {len(values)}")
        if len(set(values)) != 1:
            raise ValueError(f"mix_chord: all entries of step must be equal (one training step), got {sorted(set(values))}")
        return max(values)

    def compute(self, logprob, old_logprob, action_mask, advantages, expert_mask, step, **_):
        global_step = self.global_step_of(step, logprob.shape[0])
        mu = mu_schedule_function(
            global_step, self.mu_warmup_steps, self.mu_decay_steps, self.mu_peak, self.mu_valley
        )
        loss, metrics = self.mixed_loss(logprob, old_logprob, action_mask, advantages, expert_mask, mu)
        metrics["mu"] = mu
        return loss, metrics

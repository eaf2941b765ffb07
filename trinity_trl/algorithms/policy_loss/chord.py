"""CHORD (``mix_chord``): on-policy PPO + φ-weighted SFT with a scheduled weight μ (docs/algorithms/chord.md#chord)."""

from __future__ import annotations

import math
import numbers
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
    """CHORD: ``(1−μ)·L_u + μ·L_e`` with μ from `mu_schedule_function` at the batch's step.

    Shapes: ``logprob``, ``old_logprob``, ``advantages``, ``action_mask``: ``(B, T)``;
    ``expert_mask``: ``(B,)`` bool; ``step``: the current global step, either a plain ``int`` or,
    as in docs/algorithms/chord.md#chord, a ``(B,)`` tensor or sequence of ints that are all equal.

    Args:
        mu_warmup_steps, mu_decay_steps, mu_peak, mu_valley: μ's schedule (`mu_schedule_function`);
            steps ``>= 0``, peak and valley in ``[0, 1]``.
        enable_phi_function: train expert rows with ``sft_phi`` (φ-weighted) instead of plain ``sft``.
        Every other argument: see `ExpertMixLossFn` (the per-sample weights, or Trinity's
        batch geometry; a preset uses ``clip_range=0.2``).

    These defaults are declared once, in this signature; `ChordConfig`'s μ fields of the same names are passed
    here as they are (a field left unset keeps the default).
    """

    inputs = ("old_logprob", "action_mask", "advantages", "expert_mask", "step")
    preset_defaults = {"clip_range": 0.2}

    def __init__(
        self,
        backend: str = "trl",
        mu_warmup_steps: int = 0,
        mu_decay_steps: int = 0,
        mu_peak: float = 0.1,
        mu_valley: float = 0.1,
        enable_phi_function: bool = True,
        **shared: Any,
    ):
        if mu_warmup_steps < 0 or mu_decay_steps < 0:
            raise ValueError(
                f"mix_chord: mu_warmup_steps and mu_decay_steps must be >= 0, got {mu_warmup_steps}, {mu_decay_steps}"
            )
        self.mu_warmup_steps, self.mu_decay_steps = mu_warmup_steps, mu_decay_steps
        self.mu_peak = _unit_interval("mix_chord", "mu_peak", mu_peak)
        self.mu_valley = _unit_interval("mix_chord", "mu_valley", mu_valley)
        self.enable_phi_function = bool(enable_phi_function)  # read by build_sft_loss_fn below
        super().__init__(backend, **shared)

    def card_note(self) -> str | None:
        """The CHORD variant (CHORD-μ: plain SFT term; CHORD-φ: φ-weighted) and μ's schedule."""
        variant = (
            "CHORD-φ (SFT tokens weighted by φ(p) = p(1 − p))"
            if self.enable_phi_function
            else "CHORD-μ (plain SFT term)"
        )
        peak, valley, warmup, decay = self.mu_peak, self.mu_valley, self.mu_warmup_steps, self.mu_decay_steps
        if decay or warmup:
            schedule = (
                f"μ rises linearly from 0 to {peak} over {warmup} steps, then "
                if warmup
                else f"μ starts at {peak} and "
            ) + f"decays (cosine) to {valley} over {decay} steps"
        else:
            schedule = f"constant μ = {valley}"
        return f"Variant: {variant}; {schedule}."

    def build_sft_loss_fn(self, loss_agg_mode: str) -> PolicyLossFn:
        if self.enable_phi_function:
            return POLICY_LOSS_FN.get("sft_phi")(loss_agg_mode=loss_agg_mode, cutoff_prob=1.0)
        return super().build_sft_loss_fn(loss_agg_mode)

    def global_step_of(self, step: Any, batch_size: int) -> int:
        """The global step: ``step`` itself when it is an ``int`` (>= 0), else the one value every row
        of a ``(B,)`` tensor or sequence carries; rows from different steps are an error."""
        if isinstance(step, numbers.Integral) and not isinstance(step, bool):
            if step < 0:
                raise ValueError(f"mix_chord: step must be >= 0, got {step}")
            return int(step)
        if isinstance(step, torch.Tensor):
            if step.dim() != 1:
                raise ValueError(f"mix_chord: step must be an int or have shape (B,), got {tuple(step.shape)}")
            values = step.tolist()
        elif isinstance(step, (list, tuple)):
            values = list(step)
        else:
            raise ValueError(
                f"mix_chord: step must be an int, a (B,) tensor or a sequence of ints, got {type(step).__name__}"
            )
        if len(values) != batch_size:
            raise ValueError(f"mix_chord: step must have one entry per row ({batch_size}), got {len(values)}")
        if len(set(values)) != 1:
            raise ValueError(
                f"mix_chord: all entries of step must be equal (one training step), got {sorted(set(values))}"
            )
        return max(values)

    def mu_of(self, step: Any, rows: int) -> float:
        """μ at the batch's ``step`` (`global_step_of`)."""
        schedule = (self.mu_warmup_steps, self.mu_decay_steps, self.mu_peak, self.mu_valley)
        return mu_schedule_function(self.global_step_of(step, rows), *schedule)

    def token_losses(self, logprob, old_logprob, action_mask, advantages, expert_mask, step, **_):
        values, metrics = super().token_losses(logprob, old_logprob, action_mask, advantages, expert_mask)
        metrics["mu"] = self.mu_of(step, logprob.shape[0])
        return values, metrics


MIXCHORDPolicyLossFn = CHORDPolicyLossFn  # the class's name in Trinity-RFT

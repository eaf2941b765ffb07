"""CHORD (``mix_chord``): on-policy PPO + φ-weighted SFT with a scheduled weight μ (spec §9.3)."""

from __future__ import annotations

import math


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

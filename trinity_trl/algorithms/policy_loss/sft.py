"""SFT losses: plain, importance-weighted and φ-weighted (spec §8.2-§8.4)."""

from __future__ import annotations

import torch


def phi_function(token_prob: torch.Tensor) -> torch.Tensor:
    """CHORD's φ weight ``p·(1−p)``: small for tokens the model finds very unlikely or already certain."""
    return token_prob * (1.0 - token_prob)

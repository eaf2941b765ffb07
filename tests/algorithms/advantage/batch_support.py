"""Helpers for the tests of batch (trainer-side) advantage functions."""

from __future__ import annotations

import torch
from tolerance import approx

from trinity_trl.algorithms.advantage import ADVANTAGE_FN

from ..conftest import MASK_ROWS, make_batch

BATCH_TERMS = 6 * 5  # docs/algorithms/reference-values.md#batch-advantage-values: B = 6, T = 5


def run_fn(key: str, batch=None, **kwargs):
    return ADVANTAGE_FN.get(key)(**kwargs)(make_batch() if batch is None else batch)


def assert_rows(advantages: torch.Tensor, per_row: list[float], masked_zero: bool = True) -> None:
    mask = torch.tensor(MASK_ROWS, dtype=torch.bool)
    for b, value in enumerate(per_row):
        for v in advantages[b][mask[b]].tolist():
            # statistics over the (6, 5) batch's 30 tokens in float32; |A| < 2 sets the scale
            # (docs/algorithms/reference-values.md#batch-advantage-values)
            assert v == approx(value, terms=BATCH_TERMS, scale=2.0), (b, v, value)
        if masked_zero:
            assert torch.all(advantages[b][~mask[b]] == 0)


def naive_discounted_sum(x: torch.Tensor, discount: float) -> torch.Tensor:
    """Right-to-left Python loop (test-only reference), float64."""
    x = x.to(torch.float64)
    out = torch.zeros_like(x)
    running = torch.zeros_like(x[..., 0])
    for t in reversed(range(x.shape[-1])):
        running = x[..., t] + discount * running
        out[..., t] = running
    return out


def distill_batch(old_key="old_log_probs") -> dict:
    g = torch.Generator().manual_seed(3)
    mask = torch.tensor(MASK_ROWS, dtype=torch.bool)
    return {
        "teacher_logprobs": -torch.rand(6, 5, generator=g),
        old_key: -torch.rand(6, 5, generator=g),
        "response_mask": mask,
    }


def nan_padded(batch: dict, key: str) -> dict:
    mask = batch["response_mask"]
    batch[key] = torch.where(mask, batch[key], torch.full_like(batch[key], float("nan")))
    return batch

"""On-policy distillation advantage (docs/algorithms/advantages.md#batch-functions)."""

from __future__ import annotations

import pytest
import torch
from tolerance import approx, assert_close

from .batch_support import BATCH_TERMS, distill_batch, nan_padded, run_fn


@pytest.mark.parametrize("old_key", ["old_log_probs", "old_logprob", "old_per_token_logps"])
def test_on_policy_distill(old_key):
    batch = distill_batch(old_key)
    teacher, old, mask = batch["teacher_logprobs"], batch[old_key], batch["response_mask"].float()
    out, metrics = run_fn("on_policy_distill", batch, kl_coef=0.5)
    expected = 0.5 * (teacher - old) * mask
    assert_close(out["advantages"], expected)  # elementwise: a difference and a product
    assert torch.equal(out["returns"], out["advantages"]) and out["returns"] is not out["advantages"]
    k = ((old - teacher) * mask).sum(-1)
    assert metrics["kl/mean"] == approx(k.mean().item(), terms=BATCH_TERMS, scale=2.0)
    assert metrics["kl/std"] == approx(k.std().item(), terms=BATCH_TERMS, scale=2.0)
    assert metrics["advantages/mean"] == approx(expected.sum(-1).mean().item(), terms=BATCH_TERMS, scale=2.0)
    assert set(metrics) == {"kl/mean", "kl/std", "advantages/mean"}


def test_on_policy_distill_single_row_std_is_zero():
    batch = {key: value[:1] for key, value in distill_batch().items()}
    _, metrics = run_fn("on_policy_distill", batch)
    assert metrics["kl/std"] == 0.0


@pytest.mark.parametrize("key", ["teacher_logprobs", "old_log_probs"])
def test_nan_padding_does_not_leak_into_on_policy_distill(key):
    clean, clean_metrics = run_fn("on_policy_distill", distill_batch())
    dirty, dirty_metrics = run_fn("on_policy_distill", nan_padded(distill_batch(), key))
    assert torch.equal(dirty["advantages"], clean["advantages"])
    assert dirty_metrics == clean_metrics

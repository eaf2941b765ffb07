"""verl-compatible functions (``functional.py``: ``compute_policy_loss``, ``kl_penalty``)."""

from __future__ import annotations

import math

import pytest
import torch
from tolerance import assert_close

from trinity_trl.algorithms import compute_policy_loss, kl_penalty

from .support import spec_value


def test_verl_compute_policy_loss_matches_registry_ppo(policy_data):
    d = policy_data
    loss, clipfrac, ppo_kl, clipfrac_lower = compute_policy_loss(
        old_log_prob=d["old_logprob"],
        log_prob=d["logprob"],
        advantages=d["advantages"],
        response_mask=d["action_mask"],
        cliprange=0.2,
    )
    assert loss.item() == spec_value(
        0.26889559626579285
    )  # docs/algorithms/reference-values.md#policy-loss-values (tolerance: tests/algorithms/support.py)
    assert clipfrac.item() == spec_value(0.3541666567325592)
    assert ppo_kl.item() == spec_value(-0.21663446724414825)
    assert clipfrac_lower.item() == spec_value(0.0625)
    with pytest.raises(ValueError):
        compute_policy_loss(d["old_logprob"], d["logprob"], d["advantages"], d["action_mask"])  # no clip range


def test_verl_kl_penalty_names(kl_data):
    d = kl_data
    lp, ref = d["logprob"], d["ref_logprob"]
    # elementwise formulas, a few operations each; k3 cancels exp(ref - lp) - 1 against ref - lp, values of size e²
    assert_close(kl_penalty(lp, ref, "kl"), lp - ref)
    assert_close(kl_penalty(lp, ref, "k1"), lp - ref)
    assert_close(kl_penalty(lp, ref, "mse"), 0.5 * (lp - ref) ** 2)
    assert_close(kl_penalty(lp, ref, "abs"), (lp - ref).abs())
    assert_close(kl_penalty(lp, ref, "k3"), torch.exp(ref - lp) - 1 - (ref - lp), scale=math.e**2)
    with pytest.raises(ValueError):
        kl_penalty(lp, ref, "full")

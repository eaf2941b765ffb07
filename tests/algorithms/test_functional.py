"""verl-compatible functions (``functional.py``: ``compute_policy_loss``, ``kl_penalty``)."""

from __future__ import annotations

import pytest
import torch

from trinity_trl.algorithms import compute_policy_loss, kl_penalty


def test_verl_compute_policy_loss_matches_registry_ppo(policy_data):
    d = policy_data
    loss, clipfrac, ppo_kl, clipfrac_lower = compute_policy_loss(
        old_log_prob=d["old_logprob"],
        log_prob=d["logprob"],
        advantages=d["advantages"],
        response_mask=d["action_mask"],
        cliprange=0.2,
    )
    assert loss.item() == pytest.approx(0.26889559626579285, abs=1e-6)
    assert clipfrac.item() == pytest.approx(0.3541666567325592, abs=1e-6)
    assert ppo_kl.item() == pytest.approx(-0.21663446724414825, abs=1e-6)
    assert clipfrac_lower.item() == pytest.approx(0.0625, abs=1e-6)
    with pytest.raises(ValueError):
        compute_policy_loss(d["old_logprob"], d["logprob"], d["advantages"], d["action_mask"])  # no clip range


def test_verl_kl_penalty_names(kl_data):
    d = kl_data
    lp, ref = d["logprob"], d["ref_logprob"]
    assert torch.allclose(kl_penalty(lp, ref, "kl"), lp - ref)
    assert torch.allclose(kl_penalty(lp, ref, "k1"), lp - ref)
    assert torch.allclose(kl_penalty(lp, ref, "mse"), 0.5 * (lp - ref) ** 2)
    assert torch.allclose(kl_penalty(lp, ref, "abs"), (lp - ref).abs())
    assert torch.allclose(kl_penalty(lp, ref, "k3"), torch.exp(ref - lp) - 1 - (ref - lp))
    with pytest.raises(ValueError):
        kl_penalty(lp, ref, "full")

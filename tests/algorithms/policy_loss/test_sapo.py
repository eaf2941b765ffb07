"""SAPO policy loss, Trinity and paper forms (docs/algorithms/policy-losses.md#sapo,
docs/algorithms/trl-differences.md#sapo): docs/algorithms/reference-values.md#policy-loss-values numbers, gradients, bad
args."""

from __future__ import annotations

import pytest
import torch
from tolerance import assert_close

from ..support import AVG_RATIO, MEAN_EPSILON, PPO_KL, _grad, assert_reference_values, build, small_data

REFERENCE = [
    # (key, overrides, loss, metrics)
    ("sapo", {}, -0.05128994956612587,
     {"avg_soft_gate": 2.3191137313842773, "avg_ratio": AVG_RATIO, "pos_adv_frac": 0.3958333432674408,
      "ppo_kl": PPO_KL}),
    ("sapo", {"tau_neg": 2.0}, -0.0716615691781044, {"avg_soft_gate": 1.7199063301086426}),
    # docs/algorithms/trl-differences.md#sapo: the paper / TRL form on the same data
    ("sapo", {"form": "paper", "loss_agg_mode": "seq-mean-token-mean"}, 0.22332315146923065,
     {"avg_soft_gate": 2.3191137313842773, "avg_ratio": AVG_RATIO, "pos_adv_frac": 0.3958333432674408}),
    ("sapo", {"form": "paper"}, 0.24060268700122833, {}),
]  # fmt: skip


@pytest.mark.parametrize("key, overrides, loss, metrics", REFERENCE)
def test_reference_values(policy_data, key, overrides, loss, metrics):
    assert_reference_values(policy_data, key, overrides, loss, metrics)


def _taus(adv: torch.Tensor) -> torch.Tensor:
    """τ+ = 1.0 or τ− = 1.05 per token, in float64: ``torch.where`` with Python scalars would round 1.05 to float32
    (5e-8 relative), beyond float64's rounding of the gradients compared."""
    return torch.where(adv > 0, torch.tensor(1.0, dtype=torch.float64), torch.tensor(1.05, dtype=torch.float64))


def test_sapo_trinity_gradient_is_gate_times_reinforce():
    data = small_data()
    mask, adv = data["action_mask"], data["advantages"]
    ratio = torch.exp(data["logprob"] - data["old_logprob"])
    tau = _taus(adv)
    gate = torch.sigmoid(tau * (ratio - 1)) * 4 / tau
    assert_close(_grad(build("sapo"), data), -adv * gate * mask / mask.sum(), known_rtol=MEAN_EPSILON)
    # the paper form differentiates through the gate instead
    sig = torch.sigmoid(tau * (ratio - 1))
    paper = -adv * 4 * sig * (1 - sig) * ratio * mask / mask.sum()
    assert_close(_grad(build("sapo", form="paper"), data), paper, known_rtol=MEAN_EPSILON)


def test_sapo_on_policy_gradient_is_two_over_tau_times_the_paper_form():
    """docs/algorithms/trl-differences.md#sapo: at r = 1 Trinity's gradient is (2/τ)·(−A·∇ℓ) and the paper's is
    −A·∇ℓ."""
    data = small_data()
    data["old_logprob"] = data["logprob"].clone()
    mask, adv = data["action_mask"], data["advantages"]
    tau = _taus(adv)
    reinforce = -adv * mask / mask.sum()
    assert_close(_grad(build("sapo", form="paper"), data), reinforce, known_rtol=MEAN_EPSILON)
    assert_close(_grad(build("sapo"), data), (2 / tau) * reinforce, known_rtol=MEAN_EPSILON)


BAD_ARGS = [
    ("sapo", {"tau_neg": 0.5}, "tau_neg must be >= tau_pos, got tau_neg=0.5 < tau_pos=1.0"),
    ("sapo", {"tau_pos": 0.0}, "must be > 0"),
    ("sapo", {"tau_pos": -2.0, "tau_neg": -1.0}, "must be > 0"),
    ("sapo", {"form": "trl"}, "unknown form 'trl'; allowed: trinity, paper"),
    ("sapo", {"loss_agg_mode": "token-sum"}, "Unknown loss_agg_mode"),
]


@pytest.mark.parametrize("key, overrides, message", BAD_ARGS)
def test_bad_arguments(key, overrides, message):
    with pytest.raises(ValueError, match=message):
        build(key, **overrides)

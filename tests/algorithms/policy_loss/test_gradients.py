"""Gradient checks of several policy losses at once: finite differences where the gradient is the
derivative of the value, analytic formulas where a detached weight makes it differ on purpose."""

from __future__ import annotations

import pytest
import torch
from tolerance import assert_close

from ..support import MEAN_EPSILON, _assert_off_edges, _grad, build, small_data

# Losses whose gradient is the true derivative of their value (no stop-gradient inside).
# sft_is / sft_phi weight ℓ by a detached function of ℓ itself, which no finite difference can
# hold fixed: their gradients are checked analytically below.
EXACT_GRADIENT_CASES = [
    ("sapo", {"form": "paper", "loss_agg_mode": "seq-mean-token-mean"}),
    ("sppo", {}),
    ("importance_sampling", {}),
    ("opmd", {"tau": 0.5}),
    ("sft", {"loss_agg_mode": "seq-mean-token-sum-norm"}),
    ("dpo", {"label_smoothing": 0.1}),
]


@pytest.mark.parametrize("key, overrides", EXACT_GRADIENT_CASES)
def test_gradcheck(key, overrides):
    data = small_data()
    fn = build(key, **overrides)
    if key == "sppo":
        _assert_off_edges(torch.exp(data["logprob"] - data["old_logprob"]), [1 / 1.3, 1.3])
    logprob = data.pop("logprob").clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda lp: fn(logprob=lp, **data)[0], (logprob,), eps=1e-6, atol=1e-6)


# Losses that multiply ℓ by a detached weight of the ratio r = exp(ℓ − ℓo). Their gradient is the
# derivative of the loss with that weight held fixed; moving ℓo together with ℓ keeps r, hence the
# weight, fixed, so a finite difference along that path checks exactly the surrogate gradient.
DETACHED_RATIO_WEIGHT_CASES = [
    ("cispo", {}),
    ("cispo", {"enable_mask_clip": True, "mask_clip_range_low": 0.2, "mask_clip_range_high": 0.2}),
    ("sapo", {}),
    ("sapo", {"tau_neg": 2.0, "loss_agg_mode": "seq-mean-token-sum"}),
    ("topr", {"advantage_threshold": 0.2}),
]


@pytest.mark.parametrize("key, overrides", DETACHED_RATIO_WEIGHT_CASES)
def test_gradcheck_with_ratio_weight_held_fixed(key, overrides):
    data = small_data()
    fn = build(key, **overrides)
    log_ratio = data["logprob"] - data.pop("old_logprob")
    logprob = data.pop("logprob").clone().requires_grad_(True)

    def loss(lp):
        return fn(logprob=lp, old_logprob=lp.detach() - log_ratio, **data)[0]

    assert torch.autograd.gradcheck(loss, (logprob,), eps=1e-6, atol=1e-6)


def test_simple_reinforce_gradients():
    data = small_data()
    mask, adv = data["action_mask"], data["advantages"]
    n = mask.sum()
    ratio = torch.exp(data["logprob"] - data["old_logprob"])
    p = torch.exp(data["logprob"])
    alpha = torch.where(adv <= 0, ratio.clamp(max=1.0), torch.ones_like(ratio))
    assert_close(_grad(build("topr"), data), -alpha * adv * mask / n, known_rtol=MEAN_EPSILON)
    assert_close(_grad(build("importance_sampling"), data), -adv * ratio * mask / n, known_rtol=MEAN_EPSILON)
    assert_close(_grad(build("opmd", tau=0.5), data), -adv * mask / n / 1.5, known_rtol=MEAN_EPSILON)
    assert_close(_grad(build("sft"), data), -mask.double() / n, known_rtol=MEAN_EPSILON)
    assert_close(_grad(build("sft_is"), data), -p * mask / n, known_rtol=MEAN_EPSILON)

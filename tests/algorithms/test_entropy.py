"""Entropy loss terms (docs/algorithms/entropy.md#entropy, reference values
docs/algorithms/reference-values.md#kl-entropy-values)."""

from __future__ import annotations

import math

import pytest
import torch
from tolerance import approx, assert_close

from trinity_trl.algorithms import ENTROPY_LOSS_FN

from .support import KL_SPEC_TERMS, spec_value

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def test_entropy_default_reference(kl_data):
    loss, metrics = ENTROPY_LOSS_FN.get("default")(entropy_coef=0.01)(kl_data["entropy"], kl_data["response_mask"])
    # docs/algorithms/reference-values.md#kl-entropy-values (tolerance: tests/algorithms/support.py); the loss is
    # 0.01 times the metric
    assert metrics["entropy_loss"] == spec_value(0.5555486083030701, terms=KL_SPEC_TERMS)
    assert loss.item() == spec_value(0.005555486, terms=KL_SPEC_TERMS, scale=0.01)


def test_entropy_mix_reference(kl_data):
    fn = ENTROPY_LOSS_FN.get("mix")(entropy_coef=0.01)
    # the whole batch dict, with alias names and unrelated keys, as a trainer would pass it
    batch = {
        "entropies": kl_data["entropy"],
        "completion_mask": kl_data["response_mask"],
        "logprob": kl_data["logprob"],
    }
    loss, metrics = fn(**batch, expert_mask=torch.tensor([False, True, False, True]), loss_agg_mode="token-mean")
    assert metrics["entropy_loss"] == spec_value(0.6252748966217041, terms=KL_SPEC_TERMS)
    assert loss.item() == spec_value(0.006252748966217041, terms=KL_SPEC_TERMS, scale=0.01)


def test_entropy_args_and_errors(kl_data):
    for key in ("default", "mix", "none"):
        cls = ENTROPY_LOSS_FN.get(key)
        assert cls.default_args() == {"entropy_coef": 0.0}
        with pytest.raises(TypeError):
            cls()
    with pytest.raises(ValueError, match="expert_mask"):
        ENTROPY_LOSS_FN.get("mix")(entropy_coef=0.01)(kl_data["entropy"], kl_data["response_mask"])
    with pytest.raises(ValueError, match="expert_mask"):
        ENTROPY_LOSS_FN.get("mix")(entropy_coef=0.01)(kl_data["entropy"], kl_data["response_mask"], [True])
    with pytest.raises(ValueError):
        ENTROPY_LOSS_FN.get("default")(entropy_coef=0.01)(
            kl_data["entropy"], kl_data["response_mask"], loss_agg_mode="x"
        )
    loss, metrics = ENTROPY_LOSS_FN.get("none")(entropy_coef=0.5)(kl_data["entropy"], kl_data["response_mask"])
    assert loss.item() == 0.0 and loss.dim() == 0 and metrics == {}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("key", ["default", "mix"])
def test_entropy_nan_safe_and_empty(kl_data, key, mode):
    fn = ENTROPY_LOSS_FN.get(key)(entropy_coef=0.01)
    mask, expert = kl_data["response_mask"], torch.tensor([False, True, False, True])

    def run(entropy, mask, expert):
        entropy = entropy.clone().requires_grad_(True)
        loss, metrics = fn(entropy=entropy, action_mask=mask, expert_mask=expert, loss_agg_mode=mode)
        loss.backward()
        return loss, entropy.grad

    clean_loss, clean_grad = run(kl_data["entropy"], mask, expert)
    loss, grad = run(kl_data["entropy"].masked_fill(~mask, math.nan), mask, expert)
    # the padding is masked out before any sum: the same operations on the same values, a few ulps at most
    assert loss.item() == approx(clean_loss.item())
    assert torch.isfinite(grad).all()
    assert_close(grad, clean_grad)
    assert run(kl_data["entropy"], torch.zeros_like(mask), expert)[0].item() == 0.0
    if key == "mix":
        loss, grad = run(kl_data["entropy"].masked_fill(~mask, math.nan), mask, torch.ones(4, dtype=torch.bool))
        assert loss.item() == 0.0 and torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.parametrize(
    "key, enabled, needs_expert_mask", [("default", True, False), ("mix", True, True), ("none", False, False)]
)
def test_declared_flags(key, enabled, needs_expert_mask):
    cls = ENTROPY_LOSS_FN.get(key)
    fn = cls(**cls.default_args())
    assert cls.enabled is fn.enabled is enabled
    assert cls.needs_expert_mask is fn.needs_expert_mask is needs_expert_mask
    assert sorted(ENTROPY_LOSS_FN.names()) == ["default", "mix", "none"]

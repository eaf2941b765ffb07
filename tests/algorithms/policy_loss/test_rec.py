"""REC policy loss (docs/algorithms/policy-losses.md#rec): docs/algorithms/reference-values.md#policy-loss-values
numbers, gradients, bad args."""

from __future__ import annotations

import pytest
import torch
from tolerance import assert_close

from trinity_trl.algorithms import POLICY_LOSS_FN

from ..support import MEAN_EPSILON, as_double, build, check


@pytest.mark.parametrize(
    "overrides, loss, clipfrac",
    [
        (dict(clip_mode="none"), -0.019179895520210266, 0.0),
        (dict(clip_mode="one-side"), 0.05164290592074394, 0.3541666567325592),
        (dict(clip_mode="two-side"), 0.0011463171103969216, 0.625),
        (dict(clip_mode="ring"), 0.025809258222579956, 0.5625),
        (dict(clip_mode="gspo-one-side"), -0.01192514505237341, 0.3333333432674408),
        (dict(clip_mode="one-side", weight="importance_sampling"), 0.12062031775712967, None),
        (dict(clip_mode="gspo-one-side", weight="gspo_importance_sampling"), -0.0010820552706718445, None),
        (dict(weight="advantage", temp=0.5), -0.025423159822821617, None),
        (dict(regularizer="k2", regularizer_coef=0.1), 0.037831660360097885, None),
        (dict(regularizer="forward-kl", regularizer_coef=0.1), -0.02674008347094059, None),
    ],
)
def test_rec_reference_values(policy_data, overrides, loss, clipfrac):
    metrics = {"pg_loss": loss} if clipfrac is None else {"pg_loss": loss, "pg_clipfrac": clipfrac}
    check(build("rec", **overrides)(**policy_data), loss, metrics)


def test_rec_default_args_differ_from_constructor():
    cls = POLICY_LOSS_FN.get("rec")
    assert (cls().epsilon_low_prime, cls().epsilon_high_prime) == (0.4, 0.4)
    assert (cls.default_args()["epsilon_low_prime"], cls.default_args()["epsilon_high_prime"]) == (0.6, 2)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(clip_mode="two-side", regularizer="k2", regularizer_coef=0.3),
        dict(clip_mode="ring", weight="advantage", temp=0.7),
        dict(clip_mode="gspo-one-side", regularizer="forward-kl", regularizer_coef=0.2),
        dict(clip_mode="one-side", loss_agg_mode="seq-mean-token-sum"),
    ],
)
def test_rec_gradcheck(policy_data, overrides):
    data = as_double(policy_data)
    fn = build("rec", **overrides)
    logprob = data.pop("logprob").requires_grad_(True)
    assert torch.autograd.gradcheck(lambda lp: fn(logprob=lp, **data)[0], (logprob,))


def test_rec_detached_weights_scale_the_reinforce_gradient(policy_data):
    """IS weights and the fix_opd correction are data: the gradient is −A'·in·m/N, not d(A'·ℓ)."""
    data = dict(policy_data)
    logprob = data.pop("logprob").requires_grad_(True)
    mask = data["action_mask"].float()
    ratio = torch.exp(logprob.detach() - data["old_logprob"])
    adv = data["advantages"]
    build("rec", weight="importance_sampling", fix_opd_advantage=True)(logprob=logprob, **data)[0].backward()
    expected = -(adv * ratio + data["old_logprob"] - logprob.detach()) * mask / mask.sum()
    assert_close(logprob.grad, expected, known_rtol=MEAN_EPSILON)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(epsilon_low=0.0),
        dict(epsilon_low=1.5),
        dict(epsilon_high=0.0),
        dict(epsilon_low_prime=0.0),
        dict(epsilon_low_prime=1.1),
        dict(epsilon_high_prime=-1.0),
        dict(clip_mode="both"),
        dict(weight="is"),
        dict(regularizer="kl"),
        dict(regularizer_coef=-0.1),
        dict(temp=0.0),
        dict(loss_agg_mode="mean"),
        dict(weight="gspo_importance_sampling", clip_mode="one-side"),
    ],
)
def test_rec_rejects_bad_args(overrides):
    with pytest.raises(ValueError):
        build("rec", **overrides)


def test_rec_error_names_allowed_values():
    with pytest.raises(ValueError, match="ring"):
        build("rec", clip_mode="bad")

"""PPO-clip policy loss (docs/algorithms/policy-losses.md#ppo): every
docs/algorithms/reference-values.md#policy-loss-values row (asymmetric clip, sequence masking, fallback, aggregation
modes, importance-ratio truncation and the old variant without dual clip), validation."""

from __future__ import annotations

import pytest
import torch
from tolerance import assert_close

from ..support import MEAN_EPSILON, PPO_KL, build, spec_value

BASE_METRICS = {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "pg_loss"}
NO_DUAL_CLIP = {"clip_ratio_c": 1e9}  # the old variant (docs/algorithms/references.md#versions): with |δ| <= 2 here the
# ±20 clamp never binds

REFERENCE = [
    # (overrides, loss, metrics), all on top of default_args() (clip_range 0.2)
    ({}, 0.26889559626579285, {"pg_clipfrac": 0.3541666567325592, "pg_clipfrac_lower": 0.0625, "ppo_kl": PPO_KL}),
    ({"clip_range_high": 0.28}, 0.26235419511795044, {}),
    ({"enable_sequence_masking": True, "delta_sequence_masking": 0.1}, 0.22175675630569458,
     {"seq_mask/masked_tokens": 0.16666666666631944, "seq_mask/mean_sequence_kl": -0.21027061343193054}),
    ({"fallback_to_policy_gradient": True}, 0.1426519900560379,
     {"pg_clipfrac": 0.0, "pg_clipfrac_lower": 0.0, "ppo_kl": 0.0}),
    ({"loss_agg_mode": "seq-mean-token-sum"}, 2.5813980102539062, {}),
    ({"loss_agg_mode": "seq-mean-token-mean"}, 0.2490486204624176, {}),
    ({"loss_agg_mode": "seq-mean-token-sum-norm"}, 0.645349383354187, {}),
    ({"truncate_adv_pos_is": True, "truncate_is_range_low": 0.5}, 0.26860594749450684,
     {"is_truncate_frac_pos": 0.02083333395421505}),
    ({"truncate_adv_neg_is": True, "truncate_is_range_high": 2.0}, 0.2230827361345291,
     {"is_truncate_frac_neg": 0.1041666641831398}),
    ({"truncate_adv_pos_is": True, "truncate_adv_neg_is": True, "truncate_is_range_low": 0.5,
      "truncate_is_range_high": 2.0}, 0.2227930873632431, {}),
    (NO_DUAL_CLIP, 0.28560468554496765, {}),
    ({**NO_DUAL_CLIP, "truncate_adv_pos_is": True, "truncate_is_range_low": 0.5}, 0.28531503677368164, {}),
    ({**NO_DUAL_CLIP, "truncate_adv_neg_is": True, "truncate_is_range_high": 2.0}, 0.2230827361345291, {}),
]  # fmt: skip


@pytest.mark.parametrize("overrides, loss, metrics", REFERENCE)
def test_reference_values(policy_data, overrides, loss, metrics):
    value, got = build("ppo", **overrides)(**policy_data)
    assert value.dim() == 0 and value.item() == spec_value(loss)
    extra = set()
    if overrides.get("enable_sequence_masking"):
        extra |= {"seq_mask/masked_tokens", "seq_mask/mean_sequence_kl"}
    if overrides.get("truncate_adv_pos_is"):
        extra.add("is_truncate_frac_pos")
    if overrides.get("truncate_adv_neg_is"):
        extra.add("is_truncate_frac_neg")
    assert set(got) == BASE_METRICS | extra  # option metrics appear only when the option is on
    assert all(type(v) is float for v in got.values())
    assert got["pg_loss"] == spec_value(loss)
    for name, expected in metrics.items():
        assert got[name] == spec_value(expected), name


def test_asymmetric_clip_range_resolution():
    fn = build("ppo", clip_range_high=0.28)
    assert (fn.clip_range_low, fn.clip_range_high) == (0.2, 0.28)
    fn = build("ppo", clip_range=None, clip_range_low=0.1, clip_range_high=0.3)
    assert (fn.clip_range_low, fn.clip_range_high) == (0.1, 0.3)


def test_asymmetric_clip_acts_on_the_upper_bound_only(policy_data):
    """Raising only εh changes only tokens with A > 0 whose ratio is above 1.2."""
    d = policy_data
    ratio = torch.exp(d["logprob"] - d["old_logprob"])
    affected = (d["advantages"] > 0) & (ratio > 1.2) & d["action_mask"]
    assert affected.any()
    symmetric, asymmetric = build("ppo")(**d)[0], build("ppo", clip_range_high=0.28)(**d)[0]
    assert asymmetric.item() < symmetric.item()  # a looser upper clip lowers −A·clip(r) there
    unaffected = dict(d, action_mask=d["action_mask"] & ~affected)
    assert build("ppo")(**unaffected)[0].item() == build("ppo", clip_range_high=0.28)(**unaffected)[0].item()


def test_sequence_masking_drops_negative_tokens_of_far_off_policy_rows(policy_data):
    """docs/algorithms/policy-losses.md#sequence-masking: rows whose mean clamped log-ratio ℓo − ℓ exceeds δ lose their
    A < 0 tokens, and the aggregation still divides by the original token count."""
    d = policy_data
    mask = d["action_mask"]
    seq_kl = ((d["old_logprob"] - d["logprob"]) * mask).sum(-1) / mask.sum(-1)
    far = seq_kl > 0.1
    assert far.any() and (~far).any()
    drop = (d["advantages"] < 0) & far[:, None]
    kept_mask = mask & ~drop
    plain = build("ppo")

    def token_loss(b: int, t: int) -> torch.Tensor:  # a one-token mask: token-mean is that token's loss
        single = torch.zeros_like(mask)
        single[b, t] = True
        return plain(**dict(d, action_mask=single))[0]

    # the same per-token losses with the dropped ones zeroed, over the original count
    expected = sum(token_loss(b, t) for b, t in kept_mask.nonzero().tolist()) / mask.sum()
    got, metrics = build("ppo", enable_sequence_masking=True, delta_sequence_masking=0.1)(**d)
    assert got.item() == spec_value(
        expected.item()
    )  # the reference batch (docs/algorithms/reference-values.md#policy-loss-values) summed another way
    # the metric counts dropped positions over all B×T, padding included (reference behaviour)
    assert metrics["seq_mask/masked_tokens"] == spec_value(drop.sum().item() / mask.sum().item())


def test_fallback_is_reinforce_with_ratio_one(policy_data):
    d = dict(policy_data)
    logprob = d.pop("logprob").clone().requires_grad_(True)
    loss, metrics = build("ppo", fallback_to_policy_gradient=True)(logprob=logprob, **d)
    mask = d["action_mask"].float()
    adv = d["advantages"]
    # ratio 1 in value: the loss is the token mean of −A (dual clip −3A never binds at r = 1)
    assert loss.item() == spec_value((-adv * mask).sum().item() / mask.sum().item())
    loss.backward()
    assert_close(logprob.grad, -adv * mask / mask.sum(), known_rtol=MEAN_EPSILON)  # the REINFORCE gradient
    assert metrics["ppo_kl"] == 0.0 and metrics["pg_clipfrac"] == 0.0


TRUNCATION_BAD_ARGS = [
    # docs/algorithms/policy-losses.md#is-truncation validation
    ({"truncate_adv_pos_is": True, "truncate_is_range_low": -0.1}, "truncate_is_range_low < 1 - clip_range_low"),
    ({"truncate_adv_pos_is": True, "truncate_is_range_low": 0.8}, r"= 0.8, got 0.8"),  # not < 1 − 0.2
    ({"truncate_adv_pos_is": True, "clip_range_low": 0.6, "truncate_is_range_low": 0.5}, "truncate_is_range_low"),
    ({"truncate_adv_neg_is": True, "truncate_is_range_high": 1.2}, r"truncate_is_range_high > 1 \+ clip_range_high"),
    ({"truncate_adv_neg_is": True, "clip_range_high": 1.5, "truncate_is_range_high": 2.0}, "truncate_is_range_high"),
    # both on: each bound is checked (high > low then follows: low < 1 − εl <= 1 <= 1 + εh < high)
    ({"truncate_adv_pos_is": True, "truncate_adv_neg_is": True, "truncate_is_range_low": 0.9}, "truncate_is_range_low"),
    ({"clip_ratio_c": 1.0}, "clip_ratio_c must be > 1.0"),
    ({"clip_range": None}, "clip range is unresolved"),
    ({"clip_range": -0.1}, "must be >= 0"),
    ({"loss_agg_mode": "sum"}, "Unknown loss_agg_mode"),
]  # fmt: skip


@pytest.mark.parametrize("overrides, message", TRUNCATION_BAD_ARGS)
def test_bad_arguments(overrides, message):
    with pytest.raises(ValueError, match=message):
        build("ppo", **overrides)


def test_truncation_bounds_inside_the_valid_range_are_accepted():
    build("ppo", truncate_adv_pos_is=True, truncate_is_range_low=0.0)
    build("ppo", truncate_adv_pos_is=True, truncate_is_range_low=0.79)
    build("ppo", truncate_adv_neg_is=True, truncate_is_range_high=1.21)
    # off options are not validated (their bounds are unused)
    build("ppo", truncate_is_range_low=5.0, truncate_is_range_high=-1.0)

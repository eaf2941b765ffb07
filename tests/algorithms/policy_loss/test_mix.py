"""MIX loss and the machinery it shares with CHORD (docs/algorithms/chord.md):
docs/algorithms/reference-values.md#policy-loss-values numbers, derived batch-geometry values, empty subsets, gradients,
bad args."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from trinity_trl.algorithms import POLICY_LOSS_FN
from trinity_trl.algorithms.policy_loss import BatchGeometry

from ..support import DYN, as_double, build, check, spec_value

MIX_CASES = [
    (
        {},
        0.6298247575759888,
        {
            "usual/pg_clipfrac": 0.7777777910232544,
            "usual/pg_clipfrac_lower": 0.2222222238779068,
            "usual/ppo_kl": -1.0737695693969727,
            "usual/pg_loss": 0.6921210885047913,
            "expert/sft_loss": 0.06915830634534359,
        },
    ),
    (DYN, 0.16264307498931885, {"usual/pg_loss": 0.17303027212619781, "expert/sft_loss": 0.06915830634534359}),
    (
        {**DYN, "use_dynamic_bsz": False},
        0.8132153749465942,
        {"usual/pg_loss": 0.8651513606309891, "expert/sft_loss": 0.34579153172671795},
    ),
]


@pytest.mark.parametrize("overrides, loss, metrics", MIX_CASES)
def test_mix_reference_values(policy_data, overrides, loss, metrics):
    check(build("mix", **overrides)(**policy_data), loss, {**metrics, "loss": loss})


def test_mix_derived_values_and_inner_modes():
    fn = build("mix", **DYN)
    assert (fn.experience_per_gpu, fn.gradient_accumulation) == (80, 80)
    assert (fn.train_batch_size_usual, fn.train_batch_size_expert) == (64, 16)
    assert fn.grpo_loss_fn.loss_agg_mode == fn.sft_loss_fn.loss_agg_mode == "token-mean"
    fn = build("mix", loss_agg_mode="seq-mean-token-sum", sft_loss_agg_mode="seq-mean-token-mean")
    assert fn.grpo_loss_fn.loss_agg_mode == "seq-mean-token-sum"
    assert fn.sft_loss_fn.loss_agg_mode == "seq-mean-token-mean"
    assert fn.grpo_loss_fn.clip_ratio_c == 3.0 and not fn.grpo_loss_fn.enable_sequence_masking


def test_mix_select_keys_and_sequence_advantages(policy_data):
    assert build("mix").select_keys == ["old_per_token_logps", "completion_mask", "advantages", "expert_mask"]
    data = dict(policy_data)
    per_row = data["advantages"][:, 0].clone()
    data["advantages"] = per_row
    expanded = dict(policy_data, advantages=per_row[:, None].expand(5, 20))
    assert build("mix")(**data)[0].item() == build("mix")(**expanded)[0].item()


def test_mix_gradcheck(policy_data):
    data = as_double(policy_data)
    fn = build("mix", **DYN)
    logprob = data.pop("logprob").requires_grad_(True)
    assert torch.autograd.gradcheck(lambda lp: fn(logprob=lp, **data)[0], (logprob,))


@pytest.mark.parametrize("key", ["mix", "mix_chord"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("all_expert", [False, True])
def test_empty_subset_guard(policy_data, key, mode, all_expert):
    data = dict(policy_data, expert_mask=torch.full((5,), all_expert), step=[3] * 5)
    logprob = data.pop("logprob").requires_grad_(True)
    fn = build(key, loss_agg_mode=mode)
    loss, metrics = fn(logprob=logprob, **data)
    absent, present = ("usual/", "expert/") if all_expert else ("expert/", "usual/")
    assert not any(k.startswith(absent) for k in metrics)
    assert any(k.startswith(present) for k in metrics)
    mu = 0.1
    inner = fn.sft_loss_fn if all_expert else fn.grpo_loss_fn
    inner_loss = inner(logprob=logprob.detach(), **{k: v for k, v in data.items() if k != "expert_mask"})[0]
    expected = (mu if all_expert else 1 - mu) * 5 * inner_loss.item()
    assert loss.item() == spec_value(
        expected
    )  # the reference batch (docs/algorithms/reference-values.md#policy-loss-values), mixed another way
    loss.backward()
    assert torch.isfinite(logprob.grad).all()


def test_expert_mask_must_have_one_entry_per_row(policy_data):
    with pytest.raises(ValueError, match="expert_mask"):
        build("mix")(**dict(policy_data, expert_mask=torch.tensor([True, False])))
    with pytest.raises(ValueError, match="expert_mask"):
        build("mix_chord")(**dict(policy_data, expert_mask=[True] * 6, step=[0] * 5))


@pytest.mark.parametrize(
    "overrides",
    [
        dict(clip_range=None),
        dict(loss_agg_mode="mean"),
        dict(sft_loss_agg_mode="mean"),
        dict(grpo_loss_agg_mode="mean"),
        dict(mu=1.5),
        dict(ngpus_trainer=0),
        dict(train_batch_size_usual=2, ngpus_trainer=4),
        dict(train_batch_size_expert=0),
        dict(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=4),
        dict(
            use_dynamic_bsz=True,
            ppo_mini_batch_size=2,
            ngpus_trainer=4,
            train_batch_size_usual=4,
            train_batch_size_expert=4,
        ),
    ],
)
def test_mix_rejects_bad_args(overrides):
    with pytest.raises(ValueError):
        build("mix", **overrides)


# ---------------------------------------------------------------- per-sample weights: explicit or from the geometry


def test_batch_geometry_sample_weights_formula():
    """docs/algorithms/chord.md#normalisation with the docs/algorithms/reference-values.md#policy-loss-values geometry:
    80 experiences per GPU, GA 80, Bu = 256/4, Be = 64/4."""
    dynamic = BatchGeometry(**DYN)
    assert (dynamic.experience_per_gpu, dynamic.gradient_accumulation) == (80, 80)
    assert (dynamic.usual_per_gpu, dynamic.expert_per_gpu) == (64, 16)
    assert dynamic.sample_weights(rows=5) == (80 / (5 * 64), 80 / (5 * 16))
    assert dynamic.sample_weights(rows=10) == (80 / (10 * 64), 80 / (10 * 16))  # depends on the row count
    fixed = BatchGeometry(**{**DYN, "use_dynamic_bsz": False})
    assert fixed.sample_weights(rows=5) == fixed.sample_weights(rows=10) == (80 / 64, 80 / 16)
    assert BatchGeometry().sample_weights(rows=7) == (1.0, 1.0)  # Trinity's defaults


@pytest.mark.parametrize("overrides, loss, metrics", MIX_CASES)
def test_mix_reference_values_with_explicit_weights(policy_data, overrides, loss, metrics):
    """The per-sample weights the geometry gives for this 5-row micro-batch reproduce every
    docs/algorithms/reference-values.md#policy-loss-values number."""
    w_usual, w_expert = BatchGeometry(**overrides).sample_weights(rows=5)
    fn = build("mix", usual_sample_weight=w_usual, expert_sample_weight=w_expert)
    assert fn.geometry is None and fn.sample_weights(rows=123) == (w_usual, w_expert)
    check(fn(**policy_data), loss, {**metrics, "loss": loss})


@pytest.mark.parametrize("key", ["mix", "mix_chord"])
def test_explicit_weights_exclude_the_geometry(key):
    with pytest.raises(ValueError, match="replace the batch geometry.*ppo_mini_batch_size"):
        build(key, usual_sample_weight=0.5, expert_sample_weight=0.5, ppo_mini_batch_size=4)
    with pytest.raises(ValueError, match="use_dynamic_bsz"):
        build(key, usual_sample_weight=0.5, expert_sample_weight=0.5, use_dynamic_bsz=False)
    with pytest.raises(ValueError, match="both usual_sample_weight and expert_sample_weight"):
        build(key, usual_sample_weight=0.5)
    for bad in (0.0, -1.0, math.nan, math.inf, True, "1"):
        with pytest.raises(ValueError, match="expert_sample_weight must be a finite number > 0"):
            build(key, usual_sample_weight=0.5, expert_sample_weight=bad)


@pytest.mark.parametrize("key", ["mix", "mix_chord"])
def test_constructors_take_the_spec_arguments_explicitly(key):
    cls = POLICY_LOSS_FN.get(key)
    parameters = inspect.signature(cls).parameters
    assert not any(p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) for p in parameters.values())
    spec_args = {
        "clip_range": 0.2,
        "clip_range_low": 0.2,
        "clip_range_high": 0.28,
        "use_dynamic_bsz": True,
        "ppo_mini_batch_size": 320,
        "ppo_micro_batch_size_per_gpu": 4,
        "ngpus_trainer": 4,
        "train_batch_size_usual": 256,
        "train_batch_size_expert": 64,
        "loss_agg_mode": "token-mean",
        "sft_loss_agg_mode": "seq-mean-token-mean",
        "grpo_loss_agg_mode": "seq-mean-token-sum",
    }
    spec_args.update(
        {"mu": 0.2}
        if key == "mix"
        else {"mu_warmup_steps": 1, "mu_decay_steps": 2, "mu_peak": 0.5, "mu_valley": 0.1, "enable_phi_function": False}
    )
    assert set(spec_args) | {"backend", "usual_sample_weight", "expert_sample_weight"} == set(parameters)
    fn = cls(**spec_args)
    assert fn.geometry == BatchGeometry(True, 320, 4, 4, 256, 64)
    assert (fn.grpo_loss_fn.clip_range_low, fn.grpo_loss_fn.clip_range_high) == (0.2, 0.28)
    assert (fn.grpo_loss_fn.loss_agg_mode, fn.sft_loss_fn.loss_agg_mode) == (
        "seq-mean-token-sum",
        "seq-mean-token-mean",
    )
    # only the explicit weights are keyword-only: Trinity-RFT's arguments keep their positions after backend
    assert [n for n, p in parameters.items() if p.kind is p.KEYWORD_ONLY] == [
        "usual_sample_weight",
        "expert_sample_weight",
    ]


@pytest.mark.parametrize("key", ["mix", "mix_chord"])
def test_a_call_is_placed_by_the_one_signature(key):
    """MIX and CHORD declare their own arguments; ExpertMixLossFn's follow them in one signature, which places a
    positional call and refuses an unknown keyword as a hand-written constructor would."""
    cls = POLICY_LOSS_FN.get(key)
    own = [0.2] if key == "mix" else [0, 0, 0.1, 0.1, True]  # mu; or the μ schedule and enable_phi_function
    # then Trinity-RFT's order: clip_range, _low, _high, the six batch-geometry arguments, loss_agg_mode
    fn = cls("trl", *own, 0.3, None, None, None, 8, None, None, None, None, "seq-mean-token-mean")
    assert (fn.grpo_loss_fn.clip_range_low, fn.grpo_loss_fn.clip_range_high) == (0.3, 0.3)
    assert fn.geometry.ppo_mini_batch_size == 8
    assert fn.loss_agg_mode == "seq-mean-token-mean"
    with pytest.raises(TypeError, match=rf"{cls.__name__}.__init__\(\) got an unexpected keyword argument 'foo'"):
        cls(foo=1)

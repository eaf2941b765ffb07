"""CHORD (``mix_chord``, docs/algorithms/chord.md#chord): the μ schedule,
docs/algorithms/reference-values.md#policy-loss-values numbers, the step input, gradients, bad args."""

from __future__ import annotations

import pytest
import torch
from tolerance import approx, assert_close

from trinity_trl.algorithms import POLICY_LOSS_FN, mu_schedule_function
from trinity_trl.algorithms.args import constructor_defaults
from trinity_trl.algorithms.policy_loss import BatchGeometry, CHORDPolicyLossFn

from ..support import DYN, MEAN_EPSILON, SCHEDULE, as_double, build, check


def test_mu_schedule_boundaries():
    assert mu_schedule_function(10, 10, 20, 0.7, 0.1) == 0.7
    assert mu_schedule_function(30, 10, 20, 0.7, 0.1) == 0.1
    assert mu_schedule_function(99, 10, 20, 0.7, 0.1) == 0.1
    assert mu_schedule_function(0, 0, 0, 0.7, 0.1) == 0.1
    assert mu_schedule_function(5, 0, 0, 0.7, 0.1) == 0.1
    assert mu_schedule_function(0, 10, 20, 0.7, 0.1) == 0.0
    assert mu_schedule_function(4, 10, 20, 0.7, 0.1) == approx(0.28, dtype=torch.float64)
    assert mu_schedule_function(20, 10, 20, 0.7, 0.1) == approx(0.4, dtype=torch.float64)
    assert mu_schedule_function(10, 10, 0, 0.7, 0.1) == 0.1


CHORD_CASES = [
    ({}, 0, 0.7818535566329956, {"expert/sft_phi_loss": 1.5894461274147034, "mu": 0.1}),
    *[
        (SCHEDULE, step, loss, {"mu": mu})
        for step, loss, mu in [
            (0, 0.6921210885047913, 0.0),
            (100, 0.9164523482322693, 0.25),
            (200, 1.1407835483551025, 0.5),
            (300, 1.0777066946029663, 0.42970562748477137),
            (400, 0.9254255294799805, 0.26),
            (600, 0.710067629814148, 0.02),
            (700, 0.710067629814148, 0.02),
        ]
    ],
    (
        dict(enable_phi_function=False, mu_warmup_steps=0, mu_decay_steps=200, mu_peak=0.9, mu_valley=0.05),
        50,
        0.20900075137615204,
        {"mu": 0.7755203820042827, "expert/sft_loss": 0.06915830634534359},
    ),
    (DYN, 0, 0.3146718442440033, {"usual/pg_loss": 0.17303027212619781, "expert/sft_phi_loss": 1.5894461274147034}),
]


@pytest.mark.parametrize("overrides, step, loss, metrics", CHORD_CASES)
def test_chord_reference_values(policy_data, overrides, step, loss, metrics):
    check(build("mix_chord", **overrides)(**policy_data, step=torch.full((5,), step)), loss, {**metrics, "loss": loss})


def test_chord_step_as_list_and_keys(policy_data):
    fn = build("mix_chord", **SCHEDULE)
    assert fn(**policy_data, step=[300] * 5)[1]["mu"] == approx(
        0.42970562748477137, dtype=torch.float64
    )  # Python floats
    assert fn.select_keys == ["old_per_token_logps", "completion_mask", "advantages", "expert_mask", "step"]
    assert type(build("mix_chord").sft_loss_fn) is POLICY_LOSS_FN.get("sft_phi")
    assert type(build("mix_chord", enable_phi_function=False).sft_loss_fn) is POLICY_LOSS_FN.get("sft")


@pytest.mark.parametrize("step", [[1, 1, 2, 1, 1], [1] * 4, torch.ones(5, 1, dtype=torch.int32), -1, 2.5, True])
def test_chord_rejects_bad_step(policy_data, step):
    with pytest.raises(ValueError, match="step"):
        build("mix_chord")(**policy_data, step=step)


def test_chord_needs_step(policy_data):
    with pytest.raises(ValueError, match="step"):
        build("mix_chord")(**policy_data)


@pytest.mark.parametrize(
    "overrides", [dict(mu_peak=1.5), dict(mu_valley=-0.1), dict(mu_warmup_steps=-1), dict(clip_range=None)]
)
def test_chord_rejects_bad_args(overrides):
    with pytest.raises(ValueError):
        build("mix_chord", **overrides)


def test_chord_gradcheck(policy_data):
    # φ off: φ's detached weight would make the finite-difference gradient differ on purpose
    data = as_double(policy_data)
    fn = build("mix_chord", enable_phi_function=False, **SCHEDULE)
    logprob = data.pop("logprob").requires_grad_(True)
    assert torch.autograd.gradcheck(lambda lp: fn(logprob=lp, step=[300] * 5, **data)[0], (logprob,))


def test_chord_phi_gradient_on_expert_rows(policy_data):
    data = dict(policy_data)
    logprob = data.pop("logprob").requires_grad_(True)
    build("mix_chord")(logprob=logprob, step=[0] * 5, **data)[0].backward()
    expert, mask = data["expert_mask"], data["action_mask"].float()
    p = torch.exp(logprob.detach())
    # μ · n_e·w_e · (−φ(p)·m / Σ m over expert rows)
    expected = 0.1 * 3 * (-p * (1 - p) * mask)[expert] / mask[expert].sum()
    assert_close(logprob.grad[expert], expected, known_rtol=MEAN_EPSILON)


# ---------------------------------------------------------------- the global step as an int, explicit weights


@pytest.mark.parametrize("overrides, step, loss, metrics", CHORD_CASES)
def test_chord_reference_values_with_an_int_step(policy_data, overrides, step, loss, metrics):
    """A trainer passes the global step as a plain int; the numbers are those of the (B,) form."""
    check(build("mix_chord", **overrides)(**policy_data, step=step), loss, {**metrics, "loss": loss})


def test_chord_dynamic_reference_value_with_explicit_weights(policy_data):
    w_usual, w_expert = BatchGeometry(**DYN).sample_weights(rows=5)
    fn = build("mix_chord", usual_sample_weight=w_usual, expert_sample_weight=w_expert)
    check(
        fn(**policy_data, step=0),
        0.3146718442440033,
        {"usual/pg_loss": 0.17303027212619781, "expert/sft_phi_loss": 1.5894461274147034, "loss": 0.3146718442440033},
    )


def test_mu_schedule_defaults_are_declared_in_the_signature():
    expected = {
        "mu_warmup_steps": 0,
        "mu_decay_steps": 0,
        "mu_peak": 0.1,
        "mu_valley": 0.1,
        "enable_phi_function": True,
    }
    defaults = constructor_defaults(POLICY_LOSS_FN.get("mix_chord"))
    assert {k: defaults[k] for k in expected} == expected
    assert {k: v for k, v in CHORDPolicyLossFn.default_args().items() if k in expected} == expected


def test_card_note_describes_the_loss_as_built():
    assert CHORDPolicyLossFn(clip_range=0.2).card_note() == (
        "Variant: CHORD-φ (SFT tokens weighted by φ(p) = p(1 − p)); constant μ = 0.1."
    )
    mu = CHORDPolicyLossFn(clip_range=0.2, enable_phi_function=False, mu_decay_steps=200, mu_peak=0.9, mu_valley=0.05)
    assert mu.card_note() == (
        "Variant: CHORD-μ (plain SFT term); μ starts at 0.9 and decays (cosine) to 0.05 over 200 steps."
    )
    warm = CHORDPolicyLossFn(clip_range=0.2, mu_warmup_steps=5, mu_decay_steps=10, mu_peak=0.5)
    assert "μ rises linearly from 0 to 0.5 over 5 steps, then decays (cosine) to 0.1 over 10 steps" in warm.card_note()


def test_trinity_class_name_is_importable():
    from trinity_trl.algorithms import MIXCHORDPolicyLossFn as from_package
    from trinity_trl.algorithms.policy_loss import MIXCHORDPolicyLossFn as from_family
    from trinity_trl.algorithms.policy_loss.chord import MIXCHORDPolicyLossFn as from_module

    assert from_package is from_family is from_module is CHORDPolicyLossFn is POLICY_LOSS_FN.get("mix_chord")

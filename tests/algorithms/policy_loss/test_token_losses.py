"""Per-token losses aggregated once (issue 54, item 1; docs/algorithms/custom-components.md#aggregation).

* Before and after: every registered policy loss, called as users call it, gives in float64 the loss, gradient and
  metrics it gave before per-token losses (``token_losses_before.json``, recorded by the code of commit 7fef122 on the
  cases of `SPEC_CASES`: the reference data of docs/algorithms/reference-values.md#policy-loss-values in float64, each
  aggregation mode, the MIX/CHORD variants and their empty subsets).
* The per-token method: each per-token loss's ``token_losses`` aggregated with its own mode is its public call.
* The refusals and the adapter: a per-token method that returns no ``(B, T)`` tensor on the probe call is refused when
  the loss is built, in one line; a loss written to the old contract (``compute`` with ``loss_agg_mode``) trains with
  one deprecation warning.
* MIX/CHORD row classes: each class aggregated with its own mode, count and coefficient (μ), and the trainer's
  per-class weights replacing the loss's own.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from tolerance import approx, assert_close

from ..conftest import make_policy_data
from ..support import DYN, SCHEDULE

BEFORE = pathlib.Path(__file__).with_name("token_losses_before.json")

MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
RELEASED_CHORD_MU = dict(enable_phi_function=False, mu_warmup_steps=0, mu_decay_steps=200, mu_peak=0.9, mu_valley=0.05)
#: (case id, registry key, constructor overrides over default_args(), call overrides): the §14.1 table, each mode
#: of each loss that has one, and the MIX/CHORD forms (geometry, explicit weights, modes per part, empty subsets)
SPEC_CASES: list[tuple[str, str, dict, dict]] = [
    *[(f"ppo-{mode}", "ppo", {"loss_agg_mode": mode}, {}) for mode in MODES],
    ("ppo-high", "ppo", {"clip_range_high": 0.28}, {}),
    ("ppo-seqmask", "ppo", {"enable_sequence_masking": True, "delta_sequence_masking": 0.1}, {}),
    ("ppo-fallback", "ppo", {"fallback_to_policy_gradient": True}, {}),
    ("ppo-trunc", "ppo", {"truncate_adv_pos_is": True, "truncate_is_range_low": 0.5, "truncate_adv_neg_is": True}, {}),
    *[(f"gspo-{mode}", "gspo", {"loss_agg_mode": mode}, {}) for mode in ("seq-mean-token-mean", "token-mean")],
    ("cispo", "cispo", {}, {}),
    (
        "cispo-maskclip",
        "cispo",
        {"enable_mask_clip": True, "mask_clip_range_low": 0.2, "mask_clip_range_high": 0.2},
        {},
    ),
    ("cispo-seqsum", "cispo", {"loss_agg_mode": "seq-mean-token-sum"}, {}),
    ("sapo", "sapo", {}, {}),
    ("sapo-paper", "sapo", {"form": "paper", "loss_agg_mode": "seq-mean-token-mean"}, {}),
    ("sapo-tau", "sapo", {"tau_neg": 2.0}, {}),
    ("topr", "topr", {}, {}),
    ("topr-threshold", "topr", {"advantage_threshold": 0.3, "loss_agg_mode": "seq-mean-token-sum-norm"}, {}),
    ("sppo", "sppo", {}, {}),
    ("sppo-seqmean", "sppo", {"loss_agg_mode": "seq-mean-token-mean"}, {}),
    *[(f"rec-{clip}", "rec", {"clip_mode": clip}, {}) for clip in ("none", "one-side", "two-side", "ring")],
    ("rec-gspo-one-side", "rec", {"clip_mode": "gspo-one-side", "loss_agg_mode": "token-mean"}, {}),
    ("rec-is", "rec", {"clip_mode": "one-side", "weight": "importance_sampling"}, {}),
    ("rec-gspo-is", "rec", {"clip_mode": "gspo-one-side", "weight": "gspo_importance_sampling"}, {}),
    ("rec-advantage", "rec", {"weight": "advantage", "temp": 0.5}, {}),
    ("rec-k2", "rec", {"regularizer": "k2", "regularizer_coef": 0.1}, {}),
    (
        "rec-fkl",
        "rec",
        {"regularizer": "forward-kl", "regularizer_coef": 0.1, "loss_agg_mode": "seq-mean-token-sum"},
        {},
    ),
    ("rec-opd", "rec", {"weight": "truncated_importance_sampling", "fix_opd_advantage": True}, {}),
    ("opmd", "opmd", {}, {}),
    ("opmd-tau", "opmd", {"tau": 0.5, "loss_agg_mode": "seq-mean-token-mean"}, {}),
    *[(f"sft-{mode}", "sft", {"loss_agg_mode": mode}, {}) for mode in MODES],
    ("sft_is", "sft_is", {}, {}),
    ("sft_phi", "sft_phi", {}, {}),
    ("sft_phi-cutoff", "sft_phi", {"cutoff_prob": 0.8, "loss_agg_mode": "seq-mean-token-sum"}, {}),
    ("importance_sampling", "importance_sampling", {}, {}),
    ("importance_sampling-seqmean", "importance_sampling", {"loss_agg_mode": "seq-mean-token-mean"}, {}),
    ("dpo", "dpo", {"allow_odd_rows": True}, {}),
    ("dpo-smoothing", "dpo", {"allow_odd_rows": True, "beta": 0.2, "label_smoothing": 0.1}, {}),
    ("mix", "mix", {}, {}),
    ("mix-dynamic", "mix", DYN, {}),
    ("mix-fixed", "mix", {**DYN, "use_dynamic_bsz": False}, {}),
    (
        "mix-modes",
        "mix",
        {"mu": 0.3, "grpo_loss_agg_mode": "seq-mean-token-mean", "sft_loss_agg_mode": "seq-mean-token-sum"},
        {},
    ),
    ("mix-weights", "mix", {"usual_sample_weight": 0.25, "expert_sample_weight": 0.5}, {}),
    ("mix-no-expert", "mix", {}, {"expert_mask": [False] * 5}),
    ("mix-all-expert", "mix", {"loss_agg_mode": "seq-mean-token-mean"}, {"expert_mask": [True] * 5}),
    ("chord", "mix_chord", {}, {"step": 0}),
    *[(f"chord-step{step}", "mix_chord", SCHEDULE, {"step": step}) for step in (0, 100, 300, 700)],
    ("chord-mu", "mix_chord", RELEASED_CHORD_MU, {"step": 50}),
    ("chord-dynamic", "mix_chord", DYN, {"step": 0}),
    (
        "chord-weights-modes",
        "mix_chord",
        {
            "usual_sample_weight": 0.125,
            "expert_sample_weight": 1.5,
            "grpo_loss_agg_mode": "seq-mean-token-sum-norm",
            "sft_loss_agg_mode": "seq-mean-token-mean",
        },
        {"step": 3},
    ),
]


def spec_inputs(call: dict) -> dict:
    """The reference data in float64 (``logprob`` a leaf that requires its gradient), with ``call``'s overrides."""
    data = {k: v.double() if v.is_floating_point() else v for k, v in make_policy_data().items()}
    data["logprob"].requires_grad_(True)
    for key, value in call.items():
        data[key] = torch.tensor(value) if isinstance(value, list) else value
    if "step" in data and isinstance(data["step"], int):
        data["step"] = torch.full((5,), data["step"])
    return data


def run_case(key: str, overrides: dict, call: dict) -> dict:
    """The loss, its gradient with respect to ``logprob`` and the metrics of one case, through the public call."""
    from trinity_trl.algorithms import POLICY_LOSS_FN

    cls = POLICY_LOSS_FN.get(key)
    fn = cls(**{**cls.default_args(), **overrides})
    inputs = spec_inputs(call)
    loss, metrics = fn(**inputs)
    (grad,) = torch.autograd.grad(loss, inputs["logprob"], allow_unused=True)
    grad = torch.zeros_like(inputs["logprob"]) if grad is None else grad
    return {"loss": loss.item(), "grad": grad.tolist(), "metrics": metrics}


def recorded() -> dict:
    return json.loads(BEFORE.read_text())["cases"]


def assert_as_before(got: dict, before: dict, terms: int) -> None:
    """The loss, gradient and metrics of one case equal those recorded, to the rounding of float64 sums of ``terms``
    per-token terms of magnitude at most 1 (or the value's own) taken in another order."""
    assert got["loss"] == approx(before["loss"], dtype=torch.float64, terms=terms, scale=max(1.0, abs(before["loss"])))
    grads = [torch.tensor(g, dtype=torch.float64) for g in (got["grad"], before["grad"])]
    assert_close(*grads, terms=terms, scale=1.0)
    assert set(got["metrics"]) == set(before["metrics"])
    for key, value in before["metrics"].items():
        assert got["metrics"][key] == approx(value, dtype=torch.float64, terms=terms, scale=max(1.0, abs(value))), key


def test_every_registered_loss_has_cases():
    from trinity_trl.algorithms import POLICY_LOSS_FN

    assert {key for _, key, _, _ in SPEC_CASES} == set(POLICY_LOSS_FN.names())
    assert set(recorded()) == {case for case, _, _, _ in SPEC_CASES}


@pytest.mark.parametrize("case, key, overrides, call", SPEC_CASES, ids=[c[0] for c in SPEC_CASES])
def test_each_loss_gives_the_loss_gradient_and_metrics_it_gave_before(case, key, overrides, call):
    assert_as_before(run_case(key, overrides, call), recorded()[case], terms=5 * 20)


@pytest.mark.parametrize("case, key, overrides, call", SPEC_CASES, ids=[c[0] for c in SPEC_CASES])
def test_the_public_call_is_the_per_token_losses_aggregated_with_the_own_mode(case, key, overrides, call):
    """``token_losses`` gives ``(B, T)`` per-token losses, and ``aggregate`` with no aggregation (the loss's own modes)
    is the public call, bit for bit (the same operations on the same values)."""
    from trinity_trl.algorithms import POLICY_LOSS_FN
    from trinity_trl.algorithms.policy_loss.base import TOKEN_LOSSES

    cls = POLICY_LOSS_FN.get(key)
    fn = cls(**{**cls.default_args(), **overrides})
    if cls.loss_contract != TOKEN_LOSSES:
        assert key == "dpo" and cls.weighs_samples_itself  # pairs: aggregated by the loss itself, as declared
        return
    inputs = fn.cleaned_inputs(None, spec_inputs(call))
    token_losses, metrics = fn.token_losses(**inputs)
    assert token_losses.shape == (5, 20)
    loss, metrics = fn.aggregate(token_losses, metrics, inputs)
    public, public_metrics = fn.evaluate(**spec_inputs(call))
    assert torch.equal(loss, public)
    assert metrics.keys() == public_metrics.keys()
    assert all(torch.equal(torch.as_tensor(metrics[k]), torch.as_tensor(public_metrics[k])) for k in metrics)

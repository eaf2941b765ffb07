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


#: metrics a loss logs that were added after the recording, by registry key (cispo: the share of capped weights)
METRICS_ADDED_SINCE = {"cispo": {"pg_clipfrac"}}


def assert_as_before(got: dict, before: dict, terms: int, added: set[str] = frozenset()) -> None:
    """The loss, gradient and metrics of one case equal those recorded, to the rounding of float64 sums of ``terms``
    per-token terms of magnitude at most 1 (or the value's own) taken in another order; the metrics are those recorded
    and ``added``."""
    assert got["loss"] == approx(before["loss"], dtype=torch.float64, terms=terms, scale=max(1.0, abs(before["loss"])))
    grads = [torch.tensor(g, dtype=torch.float64) for g in (got["grad"], before["grad"])]
    assert_close(*grads, terms=terms, scale=1.0)
    assert set(got["metrics"]) == set(before["metrics"]) | added
    for key, value in before["metrics"].items():
        assert got["metrics"][key] == approx(value, dtype=torch.float64, terms=terms, scale=max(1.0, abs(value))), key


#: losses written on the per-token contract after the recording, with nothing "before" to compare: their values are
#: tested against the spec in their own files (m2po: test_m2po.py)
BORN_PER_TOKEN = {"m2po"}


def test_every_registered_loss_has_cases():
    from trinity_trl.algorithms import POLICY_LOSS_FN

    assert {key for _, key, _, _ in SPEC_CASES} == set(POLICY_LOSS_FN.names()) - BORN_PER_TOKEN
    assert set(recorded()) == {case for case, _, _, _ in SPEC_CASES}


@pytest.mark.parametrize("case, key, overrides, call", SPEC_CASES, ids=[c[0] for c in SPEC_CASES])
def test_each_loss_gives_the_loss_gradient_and_metrics_it_gave_before(case, key, overrides, call):
    assert_as_before(
        run_case(key, overrides, call), recorded()[case], terms=5 * 20, added=METRICS_ADDED_SINCE.get(key, set())
    )


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


# ------------------------------------------------------------------------------------------------ MIX/CHORD classes
def chord_inputs(step: int = 300) -> dict:
    data = spec_inputs({"step": step})
    return {k: v for k, v in data.items() if k != "ref_logprob"}


def test_each_row_class_is_aggregated_with_its_own_mode_weight_and_mu():
    """CHORD's loss is ``(1−μ)·n_u·w_u·PPO + μ·n_e·w_e·SFT_φ``, each part the inner loss's public call on its own rows
    with its own mode (docs/algorithms/chord.md#normalisation), here with a different mode per part."""
    from trinity_trl.algorithms import POLICY_LOSS_FN, mu_schedule_function

    modes = {"grpo_loss_agg_mode": "seq-mean-token-sum-norm", "sft_loss_agg_mode": "seq-mean-token-mean"}
    weights = {"usual_sample_weight": 0.125, "expert_sample_weight": 1.5}
    chord = POLICY_LOSS_FN.get("mix_chord")(clip_range=0.2, **SCHEDULE, **modes, **weights)
    inputs = chord_inputs()
    loss, metrics = chord(**inputs)
    expert = inputs["expert_mask"]
    usual_rows = {k: inputs[k][~expert] for k in ("logprob", "old_logprob", "action_mask", "advantages")}
    usual, _ = POLICY_LOSS_FN.get("ppo")(clip_range=0.2, loss_agg_mode=modes["grpo_loss_agg_mode"])(**usual_rows)
    sft_phi = POLICY_LOSS_FN.get("sft_phi")(loss_agg_mode=modes["sft_loss_agg_mode"])
    demonstrations, _ = sft_phi(logprob=inputs["logprob"][expert], action_mask=inputs["action_mask"][expert])
    mu = mu_schedule_function(300, **SCHEDULE)
    usual_part, expert_part = usual * 2 * 0.125, demonstrations * 3 * 1.5
    assert loss.item() == approx((1 - mu) * usual_part.item() + mu * expert_part.item(), dtype=torch.float64, terms=100)
    assert metrics["usual/pg_loss"] == approx(usual_part.item(), dtype=torch.float64, terms=100)
    assert metrics["expert/sft_phi_loss"] == approx(expert_part.item(), dtype=torch.float64, terms=100)
    assert metrics["mu"] == mu and metrics["loss"] == loss.item()


def test_a_trainers_class_weights_replace_the_losses_own():
    """What the asynchronous CHORD trainer does each step: the same loss weighed by ``class_weights`` equals the loss
    built with those weights; a class without a weight is an error."""
    from trinity_trl.algorithms import POLICY_LOSS_FN

    cls = POLICY_LOSS_FN.get("mix_chord")
    built = cls(**cls.default_args(), usual_sample_weight=0.125, expert_sample_weight=1.5)
    default = cls(**cls.default_args())
    inputs = default.cleaned_inputs(None, chord_inputs())
    weighed, weighed_metrics = default.aggregate(
        *default.token_losses(**inputs), inputs, class_weights={"usual": 0.125, "expert": 1.5}
    )
    expected, expected_metrics = built.evaluate(**chord_inputs())
    assert torch.equal(weighed, expected)  # the same operations on the same values
    assert weighed_metrics.keys() == expected_metrics.keys()
    assert all(
        torch.equal(torch.as_tensor(weighed_metrics[k]), torch.as_tensor(expected_metrics[k])) for k in weighed_metrics
    )
    assert not torch.equal(default.evaluate(**chord_inputs())[0], expected)  # the weights do matter here
    with pytest.raises(ValueError, match=r"lack a weight for the row classes \['expert'\]"):
        default.aggregate(*default.token_losses(**inputs), inputs, class_weights={"usual": 1.0})


def test_a_loss_with_row_classes_takes_no_aggregation():
    from trinity_trl.algorithms import POLICY_LOSS_FN

    mix = POLICY_LOSS_FN.get("mix")(clip_range=0.2)
    with pytest.raises(ValueError, match="weighs its samples itself: it takes no aggregation"):
        mix(**chord_inputs(), loss_agg_mode="token-mean")
    inputs = mix.cleaned_inputs(None, chord_inputs())
    with pytest.raises(ValueError, match="aggregates its row classes with their own modes: it takes no aggregation"):
        mix.aggregate(*mix.token_losses(**inputs), inputs, "token-mean")


def test_step_sample_weights_give_each_sample_of_a_kind_one_share_of_the_step():
    """``w = micro_steps / samples of the kind``: after the trainer divides each micro-batch by ``micro_steps``, a
    sample of a kind weighs ``1 / samples``; an empty kind counts 1 (its rows are absent anyway)."""
    from trinity_trl.algorithms.policy_loss import BatchGeometry, step_sample_weights

    assert step_sample_weights(12, 3, 4) == (4 / 12, 4 / 3)
    assert step_sample_weights(6.0, 0.0, 2) == (2 / 6, 2.0)
    geometry = BatchGeometry(ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=2, train_batch_size_usual=6)
    assert geometry.sample_weights(rows=5) == step_sample_weights(6, 1, 4)  # Trinity's fixed-size branch


# ------------------------------------------------------------------------------------- the probe and the adapter
def _loss_class(name: str, body: dict):
    from trinity_trl.algorithms import PolicyLossFn

    return type(name, (PolicyLossFn,), {"__module__": __name__, "name": name, **body})


@pytest.mark.parametrize(
    "token_losses, gives",
    [
        (lambda self, logprob, action_mask, **_: (logprob * action_mask).sum() / action_mask.sum(), r"gave shape \(\)"),
        (lambda self, logprob, **_: (logprob.mean(-1), {}), r"gave shape \(2,\)"),
        (lambda self, logprob, **_: ([0.0], {}), "gave list"),
        (lambda self, logprob, old_logprob, **_: (logprob / old_logprob.sum(0)[5], {}), "raised IndexError: index 5"),
    ],
    ids=["own-mean", "per-row", "not-a-tensor", "raises"],
)
def test_a_per_token_method_that_gives_no_per_token_losses_is_refused_when_built(token_losses, gives):
    from trinity_trl.algorithms.policy_loss.base import check_aggregation_contract

    cls = _loss_class("averaging", {"token_losses": token_losses})
    with pytest.raises(
        ValueError, match=r"'averaging' .*token_losses\(\) must return .*probe call .*" + gives
    ) as error:
        check_aggregation_contract(cls())
    assert "\n" not in str(error.value)
    good = _loss_class(
        "per_token", {"token_losses": lambda self, logprob, advantages, **_: (-advantages * logprob, {})}
    )
    check_aggregation_contract(good())  # a (2, 3) tensor passes


def test_an_old_contract_loss_trains_through_the_adapter_with_one_deprecation_warning():
    """A loss written to the previous contract (``compute`` taking ``loss_agg_mode``) gives, through the adapter, what
    the same loss written as per-token losses gives, directly and with a trainer's aggregation; one warning, in one
    line, when it is built."""
    import warnings

    from trinity_trl.algorithms import agg_loss
    from trinity_trl.algorithms.policy_loss.base import OLD_CONTRACT, TOKEN_LOSSES, check_aggregation_contract
    from trinity_trl.training.loss import LossBatch, LossNormalizer

    def compute(self, logprob, old_logprob, action_mask, advantages, loss_agg_mode, **_):
        loss = agg_loss(-advantages * torch.exp(logprob - old_logprob), action_mask, loss_agg_mode)
        return loss, {"old_loss": loss.detach()}

    def token_losses(self, logprob, old_logprob, advantages, **_):
        return -advantages * torch.exp(logprob - old_logprob), {}

    old = _loss_class("old", {"compute": compute, "__init__": _with_mode})
    new = _loss_class("new", {"token_losses": token_losses, "__init__": _with_mode})
    assert (old.loss_contract, new.loss_contract) == (OLD_CONTRACT, TOKEN_LOSSES)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_aggregation_contract(old(loss_agg_mode="seq-mean-token-mean"))
        check_aggregation_contract(old())
    assert len(caught) == 1 and issubclass(caught[0].category, FutureWarning) and "\n" not in str(caught[0].message)
    assert "'old'" in str(caught[0].message) and "token_losses()" in str(caught[0].message)
    mask = spec_inputs({})["action_mask"]
    plan = LossNormalizer("micro_batch", 1, 1).plan(LossBatch(mask=mask), mask, "seq-mean-token-mean")
    for aggregation in (None, plan):
        results = []
        for cls in (old, new):
            inputs = spec_inputs({})
            loss, metrics = cls(loss_agg_mode="seq-mean-token-mean").evaluate(**inputs, loss_agg_mode=aggregation)
            results.append((loss, torch.autograd.grad(loss, inputs["logprob"])[0], metrics))
        assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
        assert results[0][2]["old_loss"] == results[1][2]["new_loss"]


def _with_mode(self, backend: str = "trl", loss_agg_mode: str = "token-mean"):
    from trinity_trl.algorithms.policy_loss.base import PolicyLossFn

    PolicyLossFn.__init__(self, backend)
    self.loss_agg_mode = loss_agg_mode


def test_row_classes_of_different_dtypes_are_aggregated_in_the_wider_one():
    """With float32 log-probs and float64 advantages the PPO part is float64 and the SFT part float32: the per-token
    losses hold both in float64 (the SFT part exactly) and each class is aggregated in float64 (before per-token
    losses the SFT part was aggregated in float32, then summed with the PPO part in float64)."""
    from trinity_trl.algorithms import POLICY_LOSS_FN

    chord = POLICY_LOSS_FN.get("mix_chord")(clip_range=0.2, **SCHEDULE)
    inputs = chord_inputs()
    mixed = {**inputs, "logprob": inputs["logprob"].detach().float(), "old_logprob": inputs["old_logprob"].float()}
    loss, _ = chord(**mixed)
    assert loss.dtype == torch.float64
    reference, _ = chord(
        **{**inputs, "logprob": mixed["logprob"].double(), "old_logprob": mixed["old_logprob"].double()}
    )
    assert loss.item() == approx(reference.item(), dtype=torch.float32, terms=100)

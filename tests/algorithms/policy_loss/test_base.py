"""What every policy loss inherits from ``PolicyLossFn`` (docs/algorithms/index.md#call-convention): input names and
``select_keys``, sequence advantages, NaN/inf in padding, all-zero masks, the backend argument, and the properties a
loss declares to a trainer (also for a loss registered from outside the package)."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from tolerance import approx, assert_close

from trinity_trl.algorithms import POLICY_LOSS_FN, agg_loss, resolve_algorithm_config
from trinity_trl.algorithms.policy_loss import PolicyLossFn
from trinity_trl.algorithms.policy_loss.ppo import PPOPolicyLossFn

from ..support import MY_KEYS, POLICY_KEYS, SCHEDULE, build, small_data

INPUTS = {
    "opmd": ("action_mask", "advantages"),
    "sft": ("action_mask",),
    "sft_is": ("action_mask",),
    "sft_phi": ("action_mask",),
    "dpo": ("ref_logprob", "action_mask"),
}


@pytest.mark.parametrize("key", MY_KEYS)
def test_inputs_and_select_keys(key):
    cls = POLICY_LOSS_FN.get(key)
    expected = INPUTS.get(key, ("old_logprob", "action_mask", "advantages"))
    assert tuple(cls.inputs) == expected
    trl_names = {
        "old_logprob": "old_per_token_logps", "ref_logprob": "ref_per_token_logps", "action_mask": "completion_mask"
    }  # fmt: skip
    verl_names = {"old_logprob": "old_log_probs", "ref_logprob": "ref_log_prob", "action_mask": "response_mask"}
    assert build(key, backend="trl").select_keys == [trl_names.get(k, k) for k in expected]
    assert build(key, backend="verl").select_keys == [verl_names.get(k, k) for k in expected]


@pytest.mark.parametrize("key", MY_KEYS)
def test_verl_and_trl_names_give_the_same_result(policy_data, key):
    fn = build(key, allow_odd_rows=True) if key == "dpo" else build(key)
    d = policy_data
    internal = fn(**d)
    verl = fn(
        log_prob=d["logprob"], old_log_probs=d["old_logprob"], ref_log_prob=d["ref_logprob"],
        response_mask=d["action_mask"], advantages=d["advantages"], unrelated_key=object(),
    )  # fmt: skip
    trl = fn(
        per_token_logps=d["logprob"], old_per_token_logps=d["old_logprob"], ref_per_token_logps=d["ref_logprob"],
        completion_mask=d["action_mask"], advantages=d["advantages"], prompt_ids=torch.zeros(5, 3), num_items=7,
    )  # fmt: skip
    for other in (verl, trl):
        assert other[0].item() == internal[0].item()
        assert other[1] == internal[1]


@pytest.mark.parametrize("key", ["gspo", "cispo", "sapo", "topr", "sppo", "importance_sampling", "opmd"])
def test_sequence_advantages_are_broadcast(policy_data, key):
    seq_adv = torch.linspace(-1.0, 1.0, 5)
    fn = build(key)
    a = fn(**{**policy_data, "advantages": seq_adv})
    b = fn(**{**policy_data, "advantages": seq_adv[:, None].expand(5, 20).clone()})
    assert a[0].item() == approx(b[0].item())  # the same values, broadcast before or inside: a few ulps at most


@pytest.mark.parametrize("key", MY_KEYS)
def test_nan_in_padding_leaks_nowhere(key):
    data = small_data()
    pad = ~data["action_mask"]
    for name in ("logprob", "old_logprob", "ref_logprob", "advantages"):
        data[name] = data[name].masked_fill(pad, float("nan"))
    fn = build(key, clip_range_low=0.2, clip_range_high=0.2) if key == "gspo" else build(key)
    logprob = data.pop("logprob").requires_grad_(True)
    loss, metrics = fn(logprob=logprob, **data)
    (grad,) = torch.autograd.grad(loss, logprob)
    assert torch.isfinite(loss) and all(math.isfinite(v) for v in metrics.values())
    assert torch.isfinite(grad).all() and (grad[pad] == 0).all()


@pytest.mark.parametrize("key", MY_KEYS)
def test_unknown_backend(key):
    with pytest.raises(ValueError, match="Unknown backend 'torch'"):
        build(key, backend="torch")


CASES = [
    ("rec", dict(clip_mode="ring", weight="truncated_importance_sampling", regularizer="k2", regularizer_coef=0.1), {}),
    ("rec", dict(clip_mode="gspo-one-side", weight="gspo_importance_sampling", fix_opd_advantage=True), {}),
    ("mix", {}, {}),
    ("mix_chord", SCHEDULE, {"step": [300] * 5}),
]


@pytest.mark.parametrize("key, overrides, extra", CASES)
def test_nan_in_masked_positions_is_ignored(policy_data, key, overrides, extra):
    fn = build(key, **overrides)
    pad = ~policy_data["action_mask"]

    def run(data):
        data = dict(data, **extra)
        logprob = data.pop("logprob").clone().requires_grad_(True)
        loss, metrics = fn(logprob=logprob, **data)
        loss.backward()
        return loss, metrics, logprob.grad

    dirty = dict(policy_data)
    for name, bad in (("logprob", math.nan), ("old_logprob", math.inf), ("advantages", math.nan)):
        dirty[name] = policy_data[name].masked_fill(pad, bad)
    clean_loss, clean_metrics, clean_grad = run(policy_data)
    loss, metrics, grad = run(dirty)
    # the padding is masked out before any sum: the same operations on the same values, a few ulps at most
    assert loss.item() == approx(clean_loss.item())
    assert metrics == approx(clean_metrics)
    assert torch.isfinite(grad).all()
    assert_close(grad, clean_grad)


@pytest.mark.parametrize("key, overrides, extra", CASES)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_all_zero_mask_gives_zero(policy_data, key, overrides, extra, mode):
    data = dict(policy_data, action_mask=torch.zeros(5, 20, dtype=torch.bool), **extra)
    loss, metrics = build(key, **{**overrides, "loss_agg_mode": mode})(**data)
    assert loss.item() == 0.0
    assert all(math.isfinite(v) for v in metrics.values())


# ---------------------------------------------------------------- backend: first positional parameter, as in Trinity


@pytest.mark.parametrize("key", POLICY_KEYS)
def test_backend_is_the_first_parameter_positionally_or_by_keyword(key):
    cls = POLICY_LOSS_FN.get(key)
    parameters = list(inspect.signature(cls).parameters.values())
    assert parameters[0].name == "backend" and parameters[0].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert parameters[0].default == "trl"
    args = cls.default_args()
    positional, keyword = cls("verl", **args), cls(backend="verl", **args)
    assert positional.backend == keyword.backend == "verl"
    assert positional.select_keys == keyword.select_keys == build(key, backend="verl").select_keys


def test_seed_style_positional_backend():
    fn = PPOPolicyLossFn("verl", clip_range=0.2)
    assert (fn.backend, fn.clip_range_low, fn.clip_range_high) == ("verl", 0.2, 0.2)
    assert fn.select_keys == ["old_log_probs", "response_mask", "advantages"]
    assert PPOPolicyLossFn(backend="verl", clip_range=0.2).select_keys == fn.select_keys
    # Trinity's positional order after backend (docs/algorithms/policy-losses.md#ppo): clip_range, clip_range_low,
    # clip_range_high, clip_ratio_c
    fn = PPOPolicyLossFn("trl", 0.2, 0.1, 0.3, 2.0)
    assert (fn.clip_range_low, fn.clip_range_high, fn.clip_ratio_c) == (0.1, 0.3, 2.0)


# ---------------------------------------------------------------- what a loss declares to a trainer

PROPERTIES = (
    "reads_advantages",
    "needs_old_logprob",
    "needs_ref_logprob",
    "needs_expert_rows",
    "needs_step",
    "linear_in_advantage",
    "sequence_level",
)
_RL = (True, True, False, False, False, True, False)  # a clipped / weighted policy gradient on rollouts
_SFT = (False, False, False, False, False, False, False)
DECLARED = {
    # key: reads_adv, old, ref, expert, step, linear, sequence-level (built from default_args())
    "ppo": _RL, "cispo": _RL, "sapo": _RL, "topr": _RL, "sppo": _RL, "rec": _RL, "importance_sampling": _RL,
    "gspo": (True, True, False, False, False, True, True),
    "opmd": (True, False, False, False, False, True, False),
    "sft": _SFT, "sft_is": _SFT, "sft_phi": _SFT,
    "dpo": (False, False, True, False, False, False, False),
    "mix": (True, True, False, True, False, True, False),
    "mix_chord": (True, True, False, True, True, True, False),
    "m2po": _RL,
}  # fmt: skip


def declared(fn) -> tuple[bool, ...]:
    values = tuple(getattr(fn, name) for name in PROPERTIES)
    assert all(type(v) is bool for v in values)
    return values


def test_every_registered_loss_has_declared_properties():
    assert sorted(DECLARED) == sorted(POLICY_LOSS_FN.names())


@pytest.mark.parametrize("key", sorted(DECLARED))
def test_declared_properties_with_default_args(key):
    assert dict(zip(PROPERTIES, declared(build(key)))) == dict(zip(PROPERTIES, DECLARED[key]))


ARGUMENT_DEPENDENT = [
    # key, overrides, {property: value}
    ("rec", {"weight": "advantage"}, {"linear_in_advantage": False, "sequence_level": False}),
    ("rec", {"regularizer": "k2", "regularizer_coef": 0.1}, {"linear_in_advantage": False}),
    ("rec", {"regularizer": "forward-kl", "regularizer_coef": 0.1}, {"linear_in_advantage": False}),
    ("rec", {"fix_opd_advantage": True}, {"linear_in_advantage": False}),
    ("rec", {"weight": "importance_sampling", "clip_mode": "one-side"}, {"linear_in_advantage": True}),
    ("rec", {"clip_mode": "gspo-one-side"}, {"sequence_level": True, "linear_in_advantage": True}),
    ("rec", {"clip_mode": "gspo-one-side", "weight": "gspo_importance_sampling"}, {"sequence_level": True}),
    ("rec", {"clip_mode": "ring"}, {"sequence_level": False}),
    ("topr", {"advantage_threshold": 0.1}, {"linear_in_advantage": False}),
    ("topr", {"advantage_threshold": -0.5}, {"linear_in_advantage": False}),
    ("topr", {"advantage_threshold": 0.0}, {"linear_in_advantage": True}),
    ("ppo", {"enable_sequence_masking": True}, {"sequence_level": True, "linear_in_advantage": True}),
    ("ppo", {"truncate_adv_pos_is": True, "truncate_is_range_low": 0.5}, {"sequence_level": False}),
    ("gspo", {"loss_agg_mode": "token-mean"}, {"sequence_level": True}),
    ("mix_chord", {"enable_phi_function": False}, {"needs_step": True, "needs_expert_rows": True}),
]


@pytest.mark.parametrize("key, overrides, expected", ARGUMENT_DEPENDENT)
def test_declared_properties_that_depend_on_arguments(key, overrides, expected):
    fn = build(key, **overrides)
    assert {name: getattr(fn, name) for name in expected} == expected
    assert all(type(getattr(fn, name)) is bool for name in PROPERTIES)


class _RefAnchoredLoss(PolicyLossFn):
    """A loss defined outside the package: REINFORCE plus ``beta·(ℓ − ℓr)²``, per token."""

    inputs = ("action_mask", "advantages", "ref_logprob")

    def __init__(self, backend: str = "trl", beta: float = 0.5, loss_agg_mode: str = "token-mean"):
        super().__init__(backend)
        self.beta, self.loss_agg_mode = beta, loss_agg_mode  # its own mode: what a direct call aggregates with

    def compute(self, logprob, action_mask, advantages, ref_logprob, loss_agg_mode, **_):
        token_loss = -advantages * logprob + self.beta * (logprob - ref_logprob) ** 2
        loss = agg_loss(token_loss, action_mask, loss_agg_mode)
        return loss, {"my_loss": loss.detach()}


@pytest.fixture
def my_loss():
    cls = POLICY_LOSS_FN.register("my_loss")(_RefAnchoredLoss)
    yield cls
    POLICY_LOSS_FN.unregister("my_loss")


def test_a_loss_defined_outside_the_package_declares_and_resolves(my_loss, policy_data):
    fn = my_loss()
    assert declared(fn) == (True, False, True, False, False, True, False)
    assert fn.select_keys == ["completion_mask", "advantages", "ref_per_token_logps"]
    assert my_loss.default_args() == {"beta": 0.5, "loss_agg_mode": "token-mean"}

    cfg = resolve_algorithm_config("grpo", policy_loss="my_loss", kl_loss="none", loss_agg_mode="seq-mean-token-mean")
    assert cfg.policy_loss.name == "my_loss"
    assert cfg.policy_loss.args == {"beta": 0.5, "loss_agg_mode": "seq-mean-token-mean"}
    assert cfg.needs_reference  # the loss reads reference log-probs, although no KL term does
    built = cfg.build_policy_loss()
    assert type(built) is my_loss and built.loss_agg_mode == "seq-mean-token-mean"
    loss, metrics = built(**policy_data)
    assert metrics["my_loss"] == pytest.approx(loss.item()) and math.isfinite(loss.item())


def test_the_custom_loss_is_gone_after_the_test():
    assert "my_loss" not in POLICY_LOSS_FN

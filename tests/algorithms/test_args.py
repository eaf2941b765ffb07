"""``default_args()`` of every registered component, pinned (docs/algorithms/index.md#default-arguments and each
component's section), and the rule that derives it from the constructor signature (``args.py``).

The dicts below were taken from the hand-written ``default_args()`` methods before they were derived
from the constructor signatures; the derivation must reproduce them value for value, including
the Python type of every value (``epsilon_high_prime`` is the int ``2``, as in the spec).
"""

from __future__ import annotations

import inspect

import pytest

from trinity_trl.algorithms import ADVANTAGE_FN, ENTROPY_LOSS_FN, KL_FN, POLICY_LOSS_FN
from trinity_trl.algorithms.advantage import GroupAdvantageFn
from trinity_trl.algorithms.args import constructor_defaults
from trinity_trl.algorithms.policy_loss import PolicyLossFn

from .support import MY_KEYS, build

_KL = {"adaptive": False, "kl_coef": 0.001}
_ENTROPY = {"entropy_coef": 0.0}

PINNED_DEFAULT_ARGS = {
    POLICY_LOSS_FN: {
        "ppo": {"clip_range": 0.2, "clip_ratio_c": 3.0, "loss_agg_mode": "token-mean", "enable_sequence_masking": False,
                "delta_sequence_masking": 0.1, "fallback_to_policy_gradient": False, "truncate_adv_pos_is": False,
                "truncate_adv_neg_is": False, "truncate_is_range_low": 0.0, "truncate_is_range_high": 2.0},
        "gspo": {"clip_range_low": 0.0003, "clip_range_high": 0.0004, "loss_agg_mode": "seq-mean-token-mean"},
        "cispo": {"clip_range_low": 1.0, "clip_range_high": 0.28, "enable_mask_clip": False, "mask_clip_range_low": 1.0,
                  "mask_clip_range_high": 0.28, "loss_agg_mode": "token-mean"},
        "sapo": {"tau_pos": 1.0, "tau_neg": 1.05, "loss_agg_mode": "token-mean"},
        "topr": {"advantage_threshold": 0.0, "loss_agg_mode": "token-mean"},
        "sppo": {"epsilon": 0.3, "loss_agg_mode": "token-mean"},
        "rec": {"epsilon_low": 0.2, "epsilon_high": 0.2, "epsilon_low_prime": 0.6, "epsilon_high_prime": 2,
                "clip_mode": "none", "weight": "none", "regularizer": "none", "regularizer_coef": 0.0, "temp": 1.0,
                "loss_agg_mode": "token-mean", "fix_opd_advantage": False},
        "opmd": {"tau": 1.0, "loss_agg_mode": "token-mean"},
        "sft": {"loss_agg_mode": "token-mean"},
        "sft_is": {"loss_agg_mode": "token-mean"},
        "sft_phi": {"loss_agg_mode": "token-mean", "cutoff_prob": 1.0},
        "dpo": {"beta": 0.1, "label_smoothing": 0.0},
        "importance_sampling": {"loss_agg_mode": "token-mean"},
        "mix": {"mu": 0.1, "clip_range": 0.2, "loss_agg_mode": "token-mean"},
        "mix_chord": {"mu_warmup_steps": 0, "mu_decay_steps": 0, "mu_peak": 0.1, "mu_valley": 0.1, "clip_range": 0.2,
                      "enable_phi_function": True, "loss_agg_mode": "token-mean"},
        "m2po": {"m2_threshold": 0.04, "loss_agg_mode": "token-mean", "log_ratio_clip": 20.0},
    },
    KL_FN: {name: _KL for name in ("none", "k1", "k2", "k3", "low_var_kl", "abs", "corrected_k3")},
    ENTROPY_LOSS_FN: {name: _ENTROPY for name in ("default", "mix", "none")},
    ADVANTAGE_FN: {
        "grpo": {"epsilon": 1e-6, "std_threshold": None, "duplicate_experiences": False, "rank_penalty": None,
                 "std_cal_level": "group"},
        "step_wise_grpo": {"epsilon": 1e-6, "enable_step_norm": False, "std_threshold": None, "std_cal_level": "group"},
        "gigpo": {"omega": 1.0, "gamma": 1.0, "fnorm": "none", "epsilon": 1e-6},
        "opmd": {"opmd_baseline": "mean", "tau": 1.0},
        "asymre": {"baseline_shift": -0.1},
        "reinforce": {},
        "rec": {"epsilon": 1e-6, "std_normalize": False, "drop": None},
        "ppo": {"gamma": 1.0, "lam": 1.0},
        "reinforceplusplus": {"gamma": 1.0},
        "rloo": {},
        "remax": {},
        "grpo_verl": {"epsilon": 1e-6},
        "opmd_verl": {"opmd_baseline": "mean", "tau": 1.0},
        "asymre_verl": {"baseline_shift": -0.1},
        "on_policy_distill": {"kl_coef": 1.0},
    },
}  # fmt: skip

PINNED = [
    (registry, name, expected) for registry, table in PINNED_DEFAULT_ARGS.items() for name, expected in table.items()
]


def test_every_registered_component_is_pinned():
    for registry, table in PINNED_DEFAULT_ARGS.items():
        assert sorted(table) == sorted(registry.names()), registry.kind


@pytest.mark.parametrize("registry, name, expected", PINNED, ids=[f"{r.kind}:{n}" for r, n, _ in PINNED])
def test_default_args_are_pinned(registry, name, expected):
    got = registry.get(name).default_args()
    assert got == expected
    assert {k: type(v) for k, v in got.items()} == {k: type(v) for k, v in expected.items()}


def test_default_args_match_spec():
    assert POLICY_LOSS_FN.get("gspo").default_args() == {
        "clip_range_low": 0.0003, "clip_range_high": 0.0004, "loss_agg_mode": "seq-mean-token-mean"
    }  # fmt: skip
    assert POLICY_LOSS_FN.get("cispo").default_args() == {
        "clip_range_low": 1.0, "clip_range_high": 0.28, "enable_mask_clip": False,
        "mask_clip_range_low": 1.0, "mask_clip_range_high": 0.28, "loss_agg_mode": "token-mean",
    }  # fmt: skip
    assert POLICY_LOSS_FN.get("sapo").default_args() == {"tau_pos": 1.0, "tau_neg": 1.05, "loss_agg_mode": "token-mean"}
    assert POLICY_LOSS_FN.get("topr").default_args() == {"advantage_threshold": 0.0, "loss_agg_mode": "token-mean"}
    assert POLICY_LOSS_FN.get("sppo").default_args() == {"epsilon": 0.3, "loss_agg_mode": "token-mean"}
    assert POLICY_LOSS_FN.get("opmd").default_args() == {"tau": 1.0, "loss_agg_mode": "token-mean"}
    assert POLICY_LOSS_FN.get("sft_phi").default_args() == {"loss_agg_mode": "token-mean", "cutoff_prob": 1.0}
    assert POLICY_LOSS_FN.get("dpo").default_args() == {"beta": 0.1, "label_smoothing": 0.0}
    for key in ("importance_sampling", "sft", "sft_is"):
        assert POLICY_LOSS_FN.get(key).default_args() == {"loss_agg_mode": "token-mean"}


def test_constructor_defaults_equal_default_args_except_gspo(policy_data):
    four_rows = {k: v[:4] for k, v in policy_data.items()}  # DPO needs whole pairs
    for key in MY_KEYS:
        if key == "gspo":
            continue
        cls = POLICY_LOSS_FN.get(key)
        assert cls()(**four_rows)[0].item() == build(key)(**four_rows)[0].item(), key
    # GSPO's constructor has no clip range at all (docs/algorithms/policy-losses.md#gspo)
    with pytest.raises(ValueError, match="clip range is unresolved"):
        POLICY_LOSS_FN.get("gspo")()
    assert POLICY_LOSS_FN.get("gspo")(clip_range=0.2).clip_range_low == 0.2


# ---------------------------------------------------------------- the derivation rule (args.py)


def test_default_args_follow_the_signature_and_preset_defaults():
    class Loss(PolicyLossFn):
        preset_defaults = {"clip": 0.2}

        def __init__(self, backend="trl", clip=None, unset=None, required_coef=None, scale=1.5, *, extension=True):
            super().__init__(backend)

    # backend, None defaults and keyword-only parameters are left out; preset_defaults win
    assert Loss.default_args() == {"clip": 0.2, "scale": 1.5}
    assert constructor_defaults(Loss) == {
        "clip": None,
        "unset": None,
        "required_coef": None,
        "scale": 1.5,
        "extension": True,
    }

    class Advantage(GroupAdvantageFn):
        def __init__(self, threshold=None, eps=1e-6, required=1):
            pass

        def process(self, experiences):
            return experiences, {}

    # advantage functions keep None defaults (their constructor is their default args)
    assert Advantage.default_args() == {"threshold": None, "eps": 1e-6, "required": 1}


def test_required_arguments_appear_only_through_preset_defaults():
    entropy = ENTROPY_LOSS_FN.get("default")
    assert inspect.signature(entropy).parameters["entropy_coef"].default is inspect.Parameter.empty
    assert entropy.preset_defaults == {"entropy_coef": 0.0}


def test_preset_defaults_must_name_a_constructor_parameter():
    with pytest.raises(TypeError, match=r"preset_defaults names \['clip_rang'\]"):

        class Typo(PolicyLossFn):  # noqa: F841
            preset_defaults = {"clip_rang": 0.2}

            def __init__(self, backend="trl", clip_range=None):
                super().__init__(backend)


def test_trinity_trl_options_are_keyword_only_and_not_preset_args():
    for key, option in (("sapo", "form"), ("dpo", "allow_odd_rows")):
        cls = POLICY_LOSS_FN.get(key)
        assert inspect.signature(cls).parameters[option].kind is inspect.Parameter.KEYWORD_ONLY
        assert option in constructor_defaults(cls) and option not in cls.default_args()


@pytest.mark.parametrize("registry, name, expected", PINNED, ids=[f"{r.kind}:{n}" for r, n, _ in PINNED])
def test_default_args_differ_from_constructor_only_where_declared(registry, name, expected):
    """Every default_args() value is the constructor's default unless ``preset_defaults`` says otherwise."""
    cls = registry.get(name)
    defaults = constructor_defaults(cls)
    for key, value in cls.default_args().items():
        if key in cls.preset_defaults:
            assert cls.preset_defaults[key] == value
        else:
            assert defaults[key] == value, key

"""The presets (Trinity-RFT's 19, `m2po` and `gigpo`) of docs/algorithms/presets.md#preset-table and configuration
resolution of docs/algorithms/presets.md#resolution."""

from __future__ import annotations

import pytest

from trinity_trl.algorithms import ALGORITHM_TYPE, POLICY_LOSS_FN, AlgorithmType, resolve_algorithm_config
from trinity_trl.algorithms.component import Component

# key: (crit, ref, adv@tr, bal, schema, repeat, sample_strategy, policy, advantage, kl_penalty, kl_loss, entropy)
TABLE = {
    "sft": (False, False, False, True, "sft", None, "default", "sft", "ppo", "none", "none", "none"),
    "ppo": (True, True, True, True, "experience", 1, "default", "ppo", "ppo", "none", "k2", "default"),
    "grpo": (False, True, False, True, "experience", 2, "default", "ppo", "grpo", "none", "k2", "default"),
    "reinforceplusplus": (
        False,
        True,
        True,
        True,
        "experience",
        2,
        "default",
        "ppo",
        "reinforceplusplus",
        "none",
        "k2",
        "default",
    ),
    "rloo": (False, True, True, True, "experience", 2, "default", "ppo", "rloo", "none", "k2", "default"),
    "opmd": (False, True, False, True, "experience", 2, "default", "opmd", "opmd", "none", "k2", "default"),
    "asymre": (False, False, False, True, "experience", 2, "default", "opmd", "asymre", "none", "none", "none"),
    "dpo": (False, True, False, False, "dpo", 2, "default", "dpo", "ppo", "none", "k2", "default"),
    "topr": (False, True, False, True, "experience", 2, "default", "topr", "reinforce", "none", "k2", "default"),
    "cispo": (False, True, False, True, "experience", 2, "default", "cispo", "grpo", "none", "k2", "default"),
    "gspo": (False, True, False, True, "experience", 2, "default", "gspo", "grpo", "none", "k2", "default"),
    "sapo": (False, True, False, True, "experience", 2, "default", "sapo", "grpo", "none", "k2", "default"),
    "mix": (False, True, False, True, "experience", 8, "mix", "mix", "grpo", "none", "k2", "mix"),
    "mix_chord": (False, True, False, True, "experience", 8, "mix", "mix_chord", "grpo", "none", "k2", "mix"),
    "raft": (False, False, False, True, "experience", None, "default", "sft", "ppo", "none", "none", "none"),
    "sppo": (False, False, False, True, "experience", 2, "default", "sppo", "opmd", "none", "none", "none"),
    "rec": (False, True, False, True, "experience", 2, "default", "rec", "rec", "none", "k2", "default"),
    "multi_step_grpo": (
        False,
        True,
        False,
        True,
        "experience",
        8,
        "default",
        "ppo",
        "step_wise_grpo",
        "none",
        "k2",
        "default",
    ),
    "gigpo": (False, True, False, True, "experience", 8, "default", "ppo", "gigpo", "none", "k2", "default"),
    "on_policy_distill": (
        False,
        False,
        True,
        True,
        "experience",
        8,
        "default",
        "ppo",
        "on_policy_distill",
        "none",
        "none",
        "none",
    ),
    "m2po": (False, False, False, True, "experience", 8, "default", "m2po", "grpo", "none", "none", "none"),
}


@pytest.mark.parametrize("key", list(TABLE))
def test_preset_flags_and_resolved_components(key):
    crit, ref, adv_tr, bal, schema, rep, strategy, policy, adv, klp, kll, ent = TABLE[key]
    preset = ALGORITHM_TYPE.get(key)
    assert (preset.use_critic, preset.use_reference, preset.compute_advantage_in_trainer, preset.can_balance_batch) == (
        crit,
        ref,
        adv_tr,
        bal,
    )
    assert preset.schema == schema
    assert preset.use_rollout == (key in ("mix", "mix_chord"))
    assert preset.default_config().get("repeat_times") == rep
    cfg = resolve_algorithm_config(key)
    assert (
        cfg.sample_strategy,
        cfg.policy_loss.name,
        cfg.advantage.name,
        cfg.kl_penalty.name,
        cfg.kl_loss.name,
        cfg.entropy_loss.name,
    ) == (strategy, policy, adv, klp, kll, ent)
    assert cfg.loss_agg_mode == "token-mean"
    assert preset.paper or key == "sft"


def test_default_config_is_a_fresh_copy():
    cfg = ALGORITHM_TYPE.get("on_policy_distill").default_config()
    assert cfg["advantage"] == Component("on_policy_distill", kl_coef=1.0)
    cfg["advantage"].args["kl_coef"] = 99.0
    assert ALGORITHM_TYPE.get("on_policy_distill").default_config()["advantage"].args == {"kl_coef": 1.0}


def test_a_preset_sets_components_only():
    from trinity_trl.algorithms.presets import _preset

    with pytest.raises(TypeError, match=r"preset 'x' sets \['policy_loss_fn'\]; a preset sets components"):
        _preset("x", description="", display_name="", policy_loss_fn="ppo")


def test_args_default_to_component_default_args_and_preset_args():
    cfg = resolve_algorithm_config("cispo")
    assert cfg.policy_loss.args == POLICY_LOSS_FN.get("cispo").default_args()
    assert resolve_algorithm_config("on_policy_distill").advantage.args == {"kl_coef": 1.0}


def test_user_args_replace_defaults_wholesale():
    # reference behaviour (docs/algorithms/presets.md#resolution step 3): clip_range is lost, so PPO cannot resolve its
    # low bound when it is built
    replaced = resolve_algorithm_config("grpo", policy_loss={"clip_range_high": 0.28})
    assert replaced.policy_loss.args == {"clip_range_high": 0.28}
    with pytest.raises(ValueError, match="clip"):
        replaced.build_policy_loss()
    cfg = resolve_algorithm_config("grpo", policy_loss={"clip_range": 0.1, "clip_range_high": 0.28})
    assert cfg.policy_loss.args == {"clip_range": 0.1, "clip_range_high": 0.28}


def test_merge_args_option_lays_user_args_over_defaults():
    cfg = resolve_algorithm_config("grpo", merge_args=True, policy_loss={"clip_range_high": 0.28})
    assert cfg.policy_loss.args["clip_range"] == 0.2
    assert cfg.policy_loss.args["clip_range_high"] == 0.28
    fn = cfg.build_policy_loss()
    assert (fn.clip_range_low, fn.clip_range_high) == (0.2, 0.28)


def test_merged_clip_range_replaces_default_specific_bounds():
    fn = resolve_algorithm_config("gspo", merge_args=True, policy_loss={"clip_range": 0.2}).build_policy_loss()
    assert (fn.clip_range_low, fn.clip_range_high) == (0.2, 0.2)
    fn = resolve_algorithm_config("gspo", merge_args=True, policy_loss={"clip_range_high": 0.001}).build_policy_loss()
    assert (fn.clip_range_low, fn.clip_range_high) == (0.0003, 0.001)


def test_global_loss_agg_mode_overrides_policy_args():
    cfg = resolve_algorithm_config("gspo")  # docs/algorithms/presets.md#resolution: GSPO's own seq-mean-token-mean is
    # overwritten
    assert cfg.policy_loss.args["loss_agg_mode"] == "token-mean"
    cfg = resolve_algorithm_config(
        "grpo",
        loss_agg_mode="seq-mean-token-sum",
        policy_loss={"clip_range": 0.2, "loss_agg_mode": "token-mean"},
    )
    assert cfg.policy_loss.args["loss_agg_mode"] == "seq-mean-token-sum"
    assert cfg.build_policy_loss().loss_agg_mode == "seq-mean-token-sum"


def test_force_loss_agg_mode_reaches_a_replace_mode_args_dict():
    # reference: a replace-mode dict without the key keeps the loss's constructor default
    cfg = resolve_algorithm_config("grpo", loss_agg_mode="seq-mean-token-sum", policy_loss={"clip_range": 0.2})
    assert "loss_agg_mode" not in cfg.policy_loss.args
    cfg = resolve_algorithm_config(
        "grpo", loss_agg_mode="seq-mean-token-sum", force_loss_agg_mode=True, policy_loss={"clip_range": 0.2}
    )
    assert cfg.build_policy_loss().loss_agg_mode == "seq-mean-token-sum"
    cfg = resolve_algorithm_config("dpo", force_loss_agg_mode=True, loss_agg_mode="seq-mean-token-sum")
    assert "loss_agg_mode" not in cfg.policy_loss.args  # dpo has no aggregation mode


def test_user_component_choice_wins_and_preset_args_do_not_leak():
    cfg = resolve_algorithm_config("grpo", policy_loss="sapo", kl_loss="low_var_kl", entropy_loss="none")
    assert (cfg.policy_loss.name, cfg.kl_loss.name, cfg.entropy_loss.name) == ("sapo", "low_var_kl", "none")
    cfg = resolve_algorithm_config("on_policy_distill", advantage="rloo")
    assert cfg.advantage.args == {}


def test_dpo_forces_two_repeats_and_a_kl_loss():
    cfg = resolve_algorithm_config("dpo", kl_loss="none", repeat_times=4)
    assert cfg.repeat_times == 2
    assert cfg.kl_loss.name == "k2"
    assert cfg.needs_reference


def test_needs_reference_follows_the_kl_choice():
    assert resolve_algorithm_config("grpo").needs_reference
    assert not resolve_algorithm_config("grpo", kl_loss="none").needs_reference
    assert not resolve_algorithm_config("asymre").needs_reference
    assert resolve_algorithm_config("asymre", kl_penalty="k1").needs_reference


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"policy_loss": "ppx"}, "policy loss 'ppx'"),
        ({"kl_loss": "k4"}, "KL function 'k4'"),
        ({"loss_agg_mode": "sum"}, "loss_agg_mode"),
        # grpo computes advantages on experience groups; the error names the config field (advantage), not advantage_fn
        ({"advantage": "rloo"}, "but advantage='rloo' is a batch function"),
        ({"policy_loss": ["clip_range", 0.2]}, "policy_loss must be a name, a mapping"),
        ({"policy_loss": {"clip_range": 0.2, "clip_rang_high": 0.3}}, "takes no argument.*clip_range_high"),
    ],
)
def test_bad_configurations_fail_at_resolution(kwargs, match):
    with pytest.raises(ValueError, match=match):
        resolve_algorithm_config("grpo", **kwargs)


def test_a_value_the_constructor_refuses_fails_when_the_component_is_built():
    # resolution checks names and types and builds nothing; the constructor checks values (a config builds its
    # components when it is constructed, tests/trainers/test_config.py)
    resolved = resolve_algorithm_config("grpo", policy_loss={"clip_range": 0.2, "clip_ratio_c": 0.5})
    with pytest.raises(ValueError, match="clip_ratio_c"):
        resolved.build_policy_loss()


def test_unknown_algorithm():
    with pytest.raises(ValueError, match="mix_chord"):
        resolve_algorithm_config("chord")


@pytest.mark.parametrize("key", list(TABLE))
def test_preset_flags_are_constants(key):
    preset = ALGORITHM_TYPE.get(key)
    for name in (
        "use_critic",
        "use_reference",
        "compute_advantage_in_trainer",
        "can_balance_batch",
        "schema",
        "default_config",
    ):
        before = getattr(preset, name)
        with pytest.raises(AttributeError, match="constant"):
            setattr(preset, name, True)
        with pytest.raises(AttributeError, match="constant"):
            delattr(preset, name)
        assert getattr(preset, name) == before
    # the defaults every preset inherits cannot change under them either
    with pytest.raises(AttributeError, match="constant"):
        AlgorithmType.use_critic = True
    assert resolve_algorithm_config(key).use_critic == TABLE[key][0]


def test_assigning_a_grpo_flag_raises():
    with pytest.raises(AttributeError):
        ALGORITHM_TYPE.get("grpo").use_critic = True
    assert ALGORITHM_TYPE.get("grpo").use_critic is False


def test_declared_recipe_and_trainer_agree_with_the_components():
    """Each preset declares its recipe and trainer (recipes/train.py compares no names); they follow from the
    components' properties: expert rows -> chord, a critic -> ppo, a step-wise advantage -> step_grpo."""
    from trinity_trl.algorithms import ADVANTAGE_FN, POLICY_LOSS_FN

    for name in ALGORITHM_TYPE.names():
        preset = ALGORITHM_TYPE.get(name)
        config = preset.default_config()
        loss = POLICY_LOSS_FN.get(config["policy_loss"].name)
        if "expert_mask" in loss.inputs:
            expected = ("chord", "ChordTrainer")
        elif preset.use_critic:
            expected = ("ppo", "PPOTrainer")
        elif ADVANTAGE_FN.get(config.get("advantage", Component("ppo")).name).step_wise:
            expected = ("step_grpo", "StepGRPOTrainer")
        else:
            expected = (
                "train",
                {"sft": "TrinitySFTTrainer", "dpo": "TrinityDPOTrainer"}.get(preset.schema, "TrinityTrainer"),
            )
        assert (preset.recipe, preset.trainer) == expected, name
        assert preset.display_name, name

"""`trinity_trl/trainers/config.py`: `TrinityConfig` (and its CISPO/SAPO subclasses).

* Every `trl.GRPOConfig` field is accounted for: a `TrainingArguments` field, a GRPO field TRL honours, or a field
  `trinity_trl` replaces by a component (and rejects when not at its default). A TRL upgrade that adds or removes a
  field fails `test_every_grpo_field_is_classified` by name.
* Algorithm resolution at config construction: presets, component names, arguments, JSON strings, merge/replace.

CISPOConfig and SAPOConfig: test_cispo.py, test_sapo.py. What a trainer rejects at construction: test_checks.py; the
reference model: test_trinity.py.
"""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest
import transformers
import trl
from datasets import Dataset
from helpers import length_reward, tiny_conversational_dataset, tiny_grpo_kwargs
from trl import GRPOConfig

from trinity_trl.algorithms import ADVANTAGE_FN, ALGORITHM_TYPE, ENTROPY_LOSS_FN, KL_FN, POLICY_LOSS_FN
from trinity_trl.trainers import TrinityConfig
from trinity_trl.trainers.config import REPLACED_GRPO_FIELDS

# ---------------------------------------------------------------------------------------------------------------------
# 1. Every GRPOConfig field is either honoured (by transformers/TRL) or replaced (and rejected when set)

# GRPOConfig fields that are not TrainingArguments fields. "replaced": a trinity_trl component does the job, so a
# non-default value is an error. "honoured": TRL's machinery (generation, vLLM, batching, rewards, reference sync,
# logging) does its usual job around our loss and advantages.
GRPO_SPECIFIC_FIELDS: dict[str, str] = {
    # model loading and forward
    "model_init_kwargs": "honoured",
    "trust_remote_code": "honoured",
    "router_aux_loss_coef": "honoured",  # TrinityTrainer._compute_loss adds the MoE aux loss like TRL
    "disable_dropout": "honoured",
    "cast_lm_head_to_fp32": "honoured",
    # batch geometry and data
    "num_generations": "honoured",
    "num_generations_eval": "honoured",
    "generation_batch_size": "honoured",
    "steps_per_generation": "honoured",
    "num_iterations": "honoured",
    "shuffle_dataset": "honoured",
    "pad_to_multiple_of": "honoured",
    # generation
    "max_completion_length": "honoured",
    "ds3_gather_for_generation": "honoured",
    "temperature": "honoured",
    "top_p": "honoured",
    "top_k": "honoured",
    "min_p": "honoured",
    "generation_kwargs": "honoured",
    "chat_template_kwargs": "honoured",
    "repetition_penalty": "honoured",
    "cache_implementation": "honoured",
    "use_transformers_continuous_batching": "honoured",
    "transformers_continuous_batching_config": "honoured",
    "use_transformers_paged": "honoured",
    "max_tool_calling_iterations": "honoured",
    "mask_truncated_completions": "honoured",
    # vLLM
    "use_vllm": "honoured",
    "vllm_mode": "honoured",
    "vllm_model_impl": "honoured",
    "vllm_enable_sleep_mode": "honoured",
    "vllm_structured_outputs_regex": "honoured",
    "vllm_server_base_url": "honoured",
    "vllm_server_host": "honoured",
    "vllm_server_port": "honoured",
    "vllm_server_timeout": "honoured",
    "vllm_group_port": "honoured",
    "vllm_gpu_memory_utilization": "honoured",
    "vllm_max_model_length": "honoured",
    "vllm_tensor_parallel_size": "honoured",
    "vllm_importance_sampling_correction": "honoured",  # TrinityTrainer._loss_inputs weights advantages by it
    "vllm_importance_sampling_mode": "honoured",
    "vllm_importance_sampling_clip_max": "honoured",
    "vllm_importance_sampling_clip_min": "honoured",
    "vllm_importance_sampling_cap": "honoured",
    # rewards (the weighted sum feeds our advantage function)
    "reward_weights": "honoured",
    # reference model synchronisation
    "sync_ref_model": "honoured",
    "ref_model_mixup_alpha": "honoured",
    "ref_model_sync_steps": "honoured",
    # logging
    "log_completions": "honoured",
    "log_multimodal": "honoured",
    "num_completions_to_print": "honoured",
    "log_unique_prompts": "honoured",
    "log_completions_hub_repo": "honoured",
    # TRL's loss, KL and advantage options: replaced by components
    "beta": "replaced",
    "loss_type": "replaced",
    "epsilon": "replaced",
    "epsilon_high": "replaced",
    "delta": "replaced",
    "importance_sampling_level": "replaced",
    "scale_rewards": "replaced",
    "multi_objective_aggregation": "replaced",
    "vespo_k_pos": "replaced",
    "vespo_lambda_pos": "replaced",
    "vespo_k_neg": "replaced",
    "vespo_lambda_neg": "replaced",
    "top_entropy_quantile": "replaced",
    "entropy_coef": "replaced",
    "use_adaptive_entropy": "replaced",
    "entropy_coef_min": "replaced",
    "entropy_coef_max": "replaced",
    "entropy_coef_delta": "replaced",
    "entropy_target": "replaced",
    "off_policy_mask_threshold": "replaced",
    "use_bias_correction_kl": "replaced",
    "sapo_temperature_pos": "replaced",
    "sapo_temperature_neg": "replaced",
}

# a valid non-default value of every replaced field (GRPOConfig.__post_init__ accepts each one)
NON_DEFAULT_VALUES: dict[str, object] = {
    "beta": 0.04,
    "loss_type": "grpo",
    "epsilon": 0.3,
    "epsilon_high": 0.28,
    "delta": 2.0,
    "importance_sampling_level": "sequence",
    "scale_rewards": "batch",  # True would map to the default "group"
    "multi_objective_aggregation": "normalize_then_sum",
    "vespo_k_pos": 2.5,
    "vespo_lambda_pos": 3.5,
    "vespo_k_neg": 3.5,
    "vespo_lambda_neg": 2.5,
    "top_entropy_quantile": 0.5,
    "entropy_coef": 0.01,
    "use_adaptive_entropy": True,
    "entropy_coef_min": 0.01,
    "entropy_coef_max": 0.5,
    "entropy_coef_delta": 0.01,
    "entropy_target": 0.3,
    "off_policy_mask_threshold": 0.5,
    "use_bias_correction_kl": False,
    "sapo_temperature_pos": 0.9,
    "sapo_temperature_neg": 2.0,
}

# TrainingArguments warns about TRL's own default `gradient_checkpointing=True` on every config built here
pytestmark = pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")


def _config(tmp_path, cls=TrinityConfig, **kwargs):
    return cls(output_dir=str(tmp_path), use_cpu=True, **kwargs)


def _grpo_field_defaults() -> dict[str, object]:
    return {f.name: f.default for f in dataclasses.fields(GRPOConfig)}


def test_trl_is_the_pinned_version():
    assert trl.__version__.startswith("1.16."), trl.__version__


def test_every_grpo_field_is_classified():
    training_args = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    grpo_fields = [f.name for f in dataclasses.fields(GRPOConfig)]
    specific = [name for name in grpo_fields if name not in training_args]
    unclassified = sorted(set(specific) - set(GRPO_SPECIFIC_FIELDS))
    assert not unclassified, f"GRPOConfig fields neither honoured nor replaced (new in TRL?): {unclassified}"
    gone = sorted(set(GRPO_SPECIFIC_FIELDS) - set(grpo_fields))
    assert not gone, f"classified fields that GRPOConfig no longer has: {gone}"
    shadowed = sorted(set(GRPO_SPECIFIC_FIELDS) & training_args)
    assert not shadowed, f"classified fields that are TrainingArguments fields (honoured by transformers): {shadowed}"
    assert set(GRPO_SPECIFIC_FIELDS.values()) == {"honoured", "replaced"}
    replaced = {name for name, kind in GRPO_SPECIFIC_FIELDS.items() if kind == "replaced"}
    assert replaced == set(REPLACED_GRPO_FIELDS)
    assert set(NON_DEFAULT_VALUES) == replaced
    # TrinityConfig keeps every GRPOConfig field and adds the algorithm fields
    trinity_fields = {f.name for f in dataclasses.fields(TrinityConfig)}
    assert set(grpo_fields) <= trinity_fields
    assert trinity_fields - set(grpo_fields) >= {
        "algorithm",
        "policy_loss",
        "advantage",
        "kl_loss",
        "kl_penalty",
        "entropy_loss",
        "loss_agg_mode",
        "component_args_mode",
    }
    assert not trinity_fields & set(TrinityConfig.removed_spellings)  # the flat fields of 0.1 are gone


def test_replaced_field_messages_name_a_real_replacement():
    """Each message names an option that exists: a TrinityConfig field, a component or a component argument."""
    known = {f.name for f in dataclasses.fields(TrinityConfig)}
    for registry in (POLICY_LOSS_FN, ADVANTAGE_FN, KL_FN, ENTROPY_LOSS_FN):
        for key in registry.names():
            known.add(key)
            known.update(inspect.signature(registry.get(key)).parameters)
    for name, replacement in REPLACED_GRPO_FIELDS.items():
        named = set(re.findall(r"[a-z][a-z0-9_]*", replacement)) & known - {name, "loss", "none", "default"}
        assert named, f"{name}: {replacement!r} names no replacement option"


# TRL fields that some policy losses declare as their own (PolicyLossFn.trl_config_fields): rejected for a loss
# that does not (cispo), accepted and passed on for one that does
DECLARED_BY_SOME_LOSSES = ("epsilon", "epsilon_high", "sapo_temperature_pos", "sapo_temperature_neg")


@pytest.mark.parametrize("name", sorted(REPLACED_GRPO_FIELDS))
def test_replaced_field_with_non_default_value_is_rejected(tmp_path, name):
    value = NON_DEFAULT_VALUES[name]
    assert value != _grpo_field_defaults()[name]
    GRPOConfig(output_dir=str(tmp_path), use_cpu=True, **{name: value})  # TRL itself accepts the value
    algorithm = "cispo" if name in DECLARED_BY_SOME_LOSSES else "grpo"
    with pytest.raises(ValueError, match=name) as info:
        _config(tmp_path, algorithm=algorithm, **{name: value})
    assert REPLACED_GRPO_FIELDS[name] in str(info.value)  # and it says what to use instead


@pytest.mark.parametrize("algorithm", ["grpo", "gspo"])
def test_trl_epsilon_fields_are_the_relative_clip_bounds(tmp_path, algorithm):
    """TRL's epsilon / epsilon_high mean exactly clip_range / clip_range_high of ppo and gspo: accepted and passed
    on."""
    loss = (
        _config(tmp_path, algorithm=algorithm, epsilon=0.3, epsilon_high=0.4).resolved_algorithm().build_policy_loss()
    )
    assert (loss.clip_range_low, loss.clip_range_high) == (0.3, 0.4)
    loss = _config(tmp_path, algorithm=algorithm, epsilon=0.25).resolved_algorithm().build_policy_loss()
    assert (loss.clip_range_low, loss.clip_range_high) == (0.25, 0.25)
    unset = _config(tmp_path, algorithm=algorithm).resolved_algorithm().build_policy_loss()
    default = POLICY_LOSS_FN.get(algorithm if algorithm == "gspo" else "ppo").default_args()
    assert unset.clip_range_low == default.get("clip_range_low", default.get("clip_range"))
    with pytest.raises(ValueError, match="epsilon_high"):
        _config(tmp_path, algorithm=algorithm, epsilon_high=0.4, policy_loss={"clip_range_high": 0.5})


def test_trl_cispo_epsilon_high_is_rejected_with_the_relative_replacement(tmp_path):
    with pytest.raises(ValueError, match=r"clip_range_high = epsilon_high - 1"):
        _config(tmp_path, algorithm="cispo", epsilon_high=5.0)


@pytest.mark.parametrize("name", sorted(REPLACED_GRPO_FIELDS))
def test_replaced_field_at_its_default_is_accepted(tmp_path, name):
    _config(tmp_path, **{name: _grpo_field_defaults()[name]})


def test_scale_rewards_true_maps_to_the_default_group(tmp_path):
    assert _config(tmp_path, scale_rewards=True).scale_rewards == "group"
    with pytest.raises(ValueError, match="scale_rewards"):
        _config(tmp_path, scale_rewards=False)  # "none"


@pytest.mark.parametrize(
    "overrides",
    [
        {"temperature": 0.7},
        {"top_p": 0.9, "top_k": 5},
        {"num_iterations": 2},
        {"reward_weights": [1.0, 0.5]},
        {"mask_truncated_completions": True},
        {"max_completion_length": 4, "num_generations": 2},
        {"log_completions": True},
        {"sync_ref_model": True, "ref_model_sync_steps": 8},
    ],
)
def test_honoured_fields_are_accepted(tmp_path, overrides):
    config = _config(tmp_path, **overrides)
    for name, value in overrides.items():
        assert getattr(config, name) == value


def test_sapo_temperatures_are_rejected_outside_sapo_and_honoured_with_it(tmp_path):
    for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
        with pytest.raises(ValueError, match=name):
            _config(tmp_path, **{name: NON_DEFAULT_VALUES[name]})  # grpo preset: ppo loss
    config = _config(tmp_path, algorithm="sapo", sapo_temperature_neg=2.0)
    args = config.resolved_algorithm().policy_loss.args
    assert args["tau_neg"] == 2.0 and args["tau_pos"] == 1.0
    # a sapo policy loss in another preset honours them too
    args = _config(tmp_path, policy_loss="sapo", sapo_temperature_pos=0.8).resolved_algorithm().policy_loss.args
    assert args["tau_pos"] == 0.8
    # and they are checked: tau_neg must be >= tau_pos
    with pytest.raises(ValueError, match="tau_neg"):
        _config(tmp_path, algorithm="sapo", sapo_temperature_pos=1.2)
    # a clash with the same key in policy_loss_fn_args is an error; the same value is not
    with pytest.raises(ValueError, match="sapo_temperature_neg"):
        _config(
            tmp_path,
            algorithm="sapo",
            sapo_temperature_neg=2.0,
            policy_loss={"tau_neg": 3.0},
        )
    same = _config(
        tmp_path,
        algorithm="sapo",
        sapo_temperature_neg=2.0,
        policy_loss={"tau_neg": 2.0},
    )
    assert same.resolved_algorithm().policy_loss.args["tau_neg"] == 2.0


# ---------------------------------------------------------------------------------------------------------------------
# 2. Resolution at config construction


@pytest.mark.parametrize("algorithm", sorted(ALGORITHM_TYPE.names()))  # every preset: tests/algorithms/test_registry.py
def test_every_preset_resolves(tmp_path, algorithm):
    resolved = _config(tmp_path, algorithm=algorithm).resolved_algorithm()
    assert resolved.algorithm == algorithm
    assert resolved.policy_loss.name == ALGORITHM_TYPE.get(algorithm).default_config()["policy_loss"].name


def test_unknown_algorithm(tmp_path):
    with pytest.raises(ValueError, match="nope"):
        _config(tmp_path, algorithm="nope")


@pytest.mark.parametrize(
    "component",
    [
        "policy_loss",
        "advantage",
        "kl_loss",
        "kl_penalty",
        "entropy_loss",
    ],
)
def test_unknown_component_name(tmp_path, component):
    with pytest.raises(ValueError, match="no_such_component"):
        _config(tmp_path, **{component: "no_such_component"})


@pytest.mark.parametrize(
    "kwargs",
    [
        {"policy_loss": {"clip_ratio_c": 0.5}},
        {"policy_loss": {"clip_range": -0.1}},
        {"advantage": {"epsilon": 0.0}},
        {"advantage": {"std_cal_level": "nope"}},
        {"kl_loss": {"kl_coef": -1.0}},
        {"kl_penalty": {"adaptive": True}},  # without target_kl / horizon
        {"algorithm": "cispo", "policy_loss": {"clip_range_low": 1.5}},
        {"algorithm": "sapo", "policy_loss": {"tau_pos": 0.0}},
        {"advantage": "rloo"},  # a batch function in a group-advantage preset
    ],
)
def test_bad_arguments_fail_at_config_construction(tmp_path, kwargs):
    with pytest.raises(ValueError):
        _config(tmp_path, **kwargs)


def test_unknown_argument_key_fails_at_config_construction(tmp_path):
    # The component constructor rejects it with a ValueError naming the key and listing the accepted ones.
    with pytest.raises(ValueError, match="not_an_arg.*clip_range"):
        _config(tmp_path, policy_loss={"not_an_arg": 1})


@pytest.mark.parametrize("field", ["loss_agg_mode", "component_args_mode", "loss_normalization"])
def test_bad_modes(tmp_path, field):
    with pytest.raises(ValueError, match="bad_mode"):
        _config(tmp_path, **{field: "bad_mode"})


def test_the_generation_fields_are_in_every_trainer_config_and_checked(tmp_path):
    """compile_generation and one_prefill_per_group (docs/generation.md): the same fields, defaults and checks in the
    synchronous and asynchronous configs, shown by the repr when changed."""
    from trinity_trl import AsyncTrinityConfig, ChordConfig, StepGRPOConfig

    for cls in (TrinityConfig, ChordConfig, StepGRPOConfig, AsyncTrinityConfig):
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        assert (defaults["compile_generation"], defaults["one_prefill_per_group"]) == ("auto", True), cls
        with pytest.raises(ValueError, match="compile_generation must be one of .*'auto', 'on', 'off'.*got 'yes'"):
            _config(tmp_path, cls, compile_generation="yes")
        with pytest.raises(ValueError, match="one_prefill_per_group must be True or False"):
            _config(tmp_path, cls, one_prefill_per_group="no")
    config = _config(tmp_path, compile_generation="off", one_prefill_per_group=False)
    assert "compile_generation='off', one_prefill_per_group=False" in repr(config)
    assert "compile_generation" not in repr(_config(tmp_path))


def test_args_given_as_json_strings_are_parsed(tmp_path):
    config = _config(
        tmp_path,
        policy_loss='{"clip_range": 0.3}',
        advantage='{"epsilon": 1e-5}',
        kl_loss='{"kl_coef": 0.01}',
        kl_penalty="{}",
        entropy_loss='{"entropy_coef": 0.002}',
    )
    assert config.policy_loss.args == {"clip_range": 0.3}
    resolved = config.resolved_algorithm()
    assert resolved.policy_loss.args["clip_range"] == 0.3
    assert resolved.advantage.args["epsilon"] == 1e-5
    assert resolved.kl_loss.args["kl_coef"] == 0.01
    assert resolved.entropy_loss.args["entropy_coef"] == 0.002
    with pytest.raises(ValueError, match="policy_loss is not a JSON object"):
        _config(tmp_path, policy_loss="{not json")


def test_trl_parser_passes_args_as_json(tmp_path):
    parser = trl.TrlParser((TrinityConfig,))
    (config,) = parser.parse_args_and_config(
        args=[
            "--output_dir",
            str(tmp_path),
            "--use_cpu",
            "True",
            "--algorithm",
            "gspo",
            "--policy_loss",
            '{"clip_range": 0.3}',
            "--kl_loss",
            "k3",
        ]
    )
    assert config.policy_loss.args == {"clip_range": 0.3}
    resolved = config.resolved_algorithm()
    assert resolved.policy_loss.name == "gspo" and resolved.kl_loss.name == "k3"
    # merge mode: the user's symmetric clip_range replaces GSPO's default specific bounds
    assert resolved.build_policy_loss().clip_range_low == resolved.build_policy_loss().clip_range_high == 0.3


def test_merge_and_replace_semantics(tmp_path):
    merged = _config(tmp_path, policy_loss={"clip_range_high": 0.28}).resolved_algorithm()
    loss = merged.build_policy_loss()
    assert (loss.clip_range_low, loss.clip_range_high) == (0.2, 0.28)
    assert merged.policy_loss.args["clip_ratio_c"] == 3.0  # the other defaults are kept
    with pytest.raises(ValueError, match="clip range is unresolved"):
        _config(
            tmp_path,
            policy_loss={"clip_range_high": 0.28},
            component_args_mode="replace",
        )
    replaced = _config(tmp_path, policy_loss={"clip_range": 0.1}, component_args_mode="replace").resolved_algorithm()
    # the user's dict alone (plus the global aggregation mode, which always reaches the policy loss)
    assert replaced.policy_loss.args == {
        "clip_range": 0.1,
        "loss_agg_mode": "token-mean",
    }
    # without user args, both modes take default_args()
    assert (
        _config(tmp_path, component_args_mode="replace").resolved_algorithm().policy_loss.args
        == _config(tmp_path).resolved_algorithm().policy_loss.args
    )


def test_global_loss_agg_mode_overrides_the_policy_loss(tmp_path):
    resolved = _config(tmp_path, loss_agg_mode="seq-mean-token-sum").resolved_algorithm()
    assert resolved.loss_agg_mode == "seq-mean-token-sum"
    assert resolved.build_policy_loss().loss_agg_mode == "seq-mean-token-sum"


def test_global_loss_agg_mode_overrides_the_policy_loss_in_replace_mode(tmp_path):
    # a replace-mode args dict without loss_agg_mode: the config's mode still reaches the policy loss, so the
    # policy, KL and entropy terms aggregate alike
    resolved = _config(
        tmp_path,
        loss_agg_mode="seq-mean-token-mean",
        component_args_mode="replace",
        policy_loss={"clip_range": 0.2},
    ).resolved_algorithm()
    assert resolved.build_policy_loss().loss_agg_mode == "seq-mean-token-mean"


# ----------------------------------------------------------------------- one typed value per component
def test_component_fields_take_a_name_a_mapping_or_a_component(tmp_path):
    from trinity_trl.algorithms.component import Component

    for value in ({"name": "cispo", "clip_range_high": 5.0}, Component("cispo", clip_range_high=5.0)):
        resolved = _config(tmp_path, policy_loss=value).resolved_algorithm()
        assert resolved.policy_loss.name == "cispo" and resolved.policy_loss.args["clip_range_high"] == 5.0
    resolved = _config(tmp_path, algorithm="gspo", policy_loss={"epsilon_high": 0.3}).resolved_algorithm()
    assert resolved.policy_loss.name == "gspo" and resolved.policy_loss.args["clip_range_high"] == 0.3
    resolved = _config(tmp_path, kl_loss="k3", entropy_loss={"entropy_coef": 0.002}).resolved_algorithm()
    assert resolved.kl_loss.name == "k3" and resolved.entropy_loss.args["entropy_coef"] == 0.002
    assert _config(tmp_path, policy_loss="cispo").to_dict()["policy_loss"] == {"name": "cispo"}


def test_component_field_errors_name_the_allowed_arguments(tmp_path):
    with pytest.raises(ValueError, match=r"takes no argument\(s\) \['clip'\].*clip_range_high: float"):
        _config(tmp_path, policy_loss={"name": "cispo", "clip": 5.0})
    with pytest.raises(ValueError, match="kl_coef must be float, got str"):
        _config(tmp_path, kl_loss={"kl_coef": "a lot"})


REMOVED = [
    ("TrinityConfig", "policy_loss_fn", "cispo", "policy_loss={'name': ...}"),
    ("TrinityConfig", "kl_penalty_fn_args", {"kl_coef": 0.1}, "kl_penalty={'argument': value}"),
    ("TrinitySFTConfig", "policy_loss_fn_args", {"cutoff_prob": 0.9}, "policy_loss={'argument': value}"),
    ("TrinityDPOConfig", "kl_loss_fn", "k3", "kl_loss={'name': ...}"),
    ("CISPOConfig", "clip_range_high", 5.0, "policy_loss={'clip_range_high': value}"),
    ("SAPOConfig", "sapo_form", "trinity", "policy_loss={'form': value}"),
    ("ChordConfig", "rl_loss_agg_mode", "token-mean", "policy_loss={'grpo_loss_agg_mode': value}"),
    ("StepGRPOConfig", "advantage_epsilon", 1e-6, "advantage={'epsilon': value}"),
]


@pytest.mark.parametrize(("config", "old", "value", "new"), REMOVED)
def test_the_spellings_of_0_1_are_refused_with_the_new_one(tmp_path, config, old, value, new):
    """Issue 37 item 2: the flat fields and the other pre-1.0 spellings are removed (CHANGELOG.md); each is a one-line
    error that gives the new spelling, not a bare ``unexpected keyword argument``."""
    import trinity_trl.trainers as trainers

    cls = getattr(trainers, config)
    assert old not in {f.name for f in dataclasses.fields(cls)}
    with pytest.raises(TypeError) as error:
        cls(output_dir=str(tmp_path), use_cpu=True, **{old: value})
    message = str(error.value)
    assert message.startswith(f"{config}: {old} was removed in trinity_trl 0.2; write {new}") and "\n" not in message


# ---------------------------------------------------------------------------------------------------------------------
# 5. TRL's own config classes are accepted and converted (issue 27 item 6)


def _trainers_with_plain_trl_config(tmp_path, model_dir):
    """``(trainer, its config class, its preset)`` for every RL trainer built with a plain ``GRPOConfig``."""
    from trinity_trl.rollouts import NumberGuessEnv, number_guess_dataset
    from trinity_trl.trainers import (
        ChordConfig,
        ChordTrainer,
        CISPOConfig,
        CISPOTrainer,
        SAPOConfig,
        SAPOTrainer,
        StepGRPOConfig,
        StepGRPOTrainer,
        TrinityTrainer,
    )

    def args(name):
        return GRPOConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path / name), max_steps=3, learning_rate=2e-4))

    data = tiny_conversational_dataset()
    expert = Dataset.from_list([{"prompt": "What is 1+1?", "completion": "The answer is 2."}])
    common = {"model": model_dir, "reward_funcs": length_reward, "train_dataset": data}
    yield CISPOTrainer(args=args("cispo"), **common), CISPOConfig, "cispo"
    yield SAPOTrainer(args=args("sapo"), **common), SAPOConfig, "sapo"
    yield TrinityTrainer(args=args("trinity"), **common), TrinityConfig, "grpo"
    yield ChordTrainer(args=args("chord"), expert_dataset=expert, **common), ChordConfig, "mix_chord"
    step = StepGRPOTrainer(
        model=model_dir, args=args("step"), train_dataset=number_guess_dataset(4), environment_factory=NumberGuessEnv
    )
    yield step, StepGRPOConfig, "multi_step_grpo"


def test_trainers_convert_a_plain_grpo_config_keeping_what_the_user_set(tmp_path, tiny_model_dir):
    for trainer, config_class, preset in _trainers_with_plain_trl_config(tmp_path, tiny_model_dir):
        name = type(trainer).__name__
        assert type(trainer.args) is config_class and trainer.algorithm.algorithm == preset, name
        assert (trainer.args.max_steps, trainer.args.learning_rate, trainer.args.num_generations) == (3, 2e-4, 4)
        assert trainer.args.max_completion_length == 8 and trainer.args.save_strategy == "no", name
        assert trainer.args.output_dir.startswith(str(tmp_path)), name


def test_a_converted_grpo_config_trains(tmp_path, tiny_model_dir):
    from trinity_trl.trainers import CISPOTrainer

    args = GRPOConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path), max_steps=1))
    trainer = CISPOTrainer(
        model=tiny_model_dir, reward_funcs=length_reward, train_dataset=tiny_conversational_dataset(), args=args
    )
    trainer.train()
    assert trainer.state.global_step == 1 and trainer.algorithm.policy_loss.name == "cispo"


@pytest.mark.parametrize(
    "field, value, replacement",
    [("beta", 0.04, "kl_loss="), ("loss_type", "grpo", "policy_loss"), ("epsilon_high", 5.0, "clip_range_high")],
)
def test_a_grpo_field_whose_meaning_differs_is_refused_naming_the_replacement(tmp_path, field, value, replacement):
    from trinity_trl.trainers import CISPOConfig
    from trinity_trl.trainers.config import from_trl_config

    args = GRPOConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path), **{field: value}))
    with pytest.raises(ValueError, match=rf"^CISPOTrainer with TRL's GRPOConfig: CISPOConfig: {field}=.*{replacement}"):
        from_trl_config(args, CISPOConfig, "CISPOTrainer")


def test_other_configs_are_still_a_type_error(tmp_path):
    from trl import DPOConfig, SFTConfig

    from trinity_trl.trainers import ChordConfig, CISPOConfig, TrinityDPOConfig, TrinitySFTConfig
    from trinity_trl.trainers.config import from_trl_config

    chord = ChordConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path)))
    with pytest.raises(TypeError, match="CISPOTrainer needs a CISPOConfig or a plain TRL GRPOConfig, got ChordConfig"):
        from_trl_config(chord, CISPOConfig, "CISPOTrainer")
    with pytest.raises(TypeError, match="needs a TrinitySFTConfig \\(or TRL's SFTConfig\\), got DPOConfig"):
        from_trl_config(DPOConfig(output_dir=str(tmp_path), use_cpu=True), TrinitySFTConfig, "TrinitySFTTrainer")
    sft = from_trl_config(
        SFTConfig(output_dir=str(tmp_path), use_cpu=True, max_length=64, max_steps=5), TrinitySFTConfig, "T"
    )
    assert type(sft) is TrinitySFTConfig and (sft.max_length, sft.max_steps) == (64, 5)
    dpo = from_trl_config(DPOConfig(output_dir=str(tmp_path), use_cpu=True, beta=0.3), TrinityDPOConfig, "T")
    assert type(dpo) is TrinityDPOConfig and dpo.beta == 0.3
    assert from_trl_config(None, CISPOConfig, "T") is None and from_trl_config(chord, ChordConfig, "T") is chord


# ---------------------------------------------------------------------------------------------------------------------
# 3. No KL term the user did not ask for (issue 43), and what a config shows is what it builds

#: the presets whose Trinity-RFT defaults add a KL loss (k2, kl_coef 0.001), which a trainer config with TRL's
#: beta=0.0 and no kl_loss no longer adds (CHANGELOG.md); dpo keeps its own (its preset always has one)
PRESETS_WITH_A_TRINITY_KL = {
    "cispo", "gigpo", "grpo", "gspo", "mix", "mix_chord", "multi_step_grpo", "opmd", "ppo", "rec",
    "reinforceplusplus", "rloo", "sapo", "topr",
}  # fmt: skip


def test_the_presets_keep_their_trinity_kl_where_a_trinity_user_reads_it():
    from trinity_trl.algorithms import resolve_algorithm_config

    with_kl = {
        name
        for name in ALGORITHM_TYPE.names()
        if KL_FN.get(resolve_algorithm_config(name).kl_loss.name).enabled and name != "dpo"
    }
    assert with_kl == PRESETS_WITH_A_TRINITY_KL
    for name in with_kl:  # resolution in algorithms/ is Trinity's: the preset's (or the global) k2
        assert resolve_algorithm_config(name).kl_loss == resolve_algorithm_config(name, kl_loss="k2").kl_loss


@pytest.mark.parametrize("algorithm", sorted(ALGORITHM_TYPE.names()))
def test_beta_zero_and_no_kl_named_trains_without_a_kl_term_and_naming_one_brings_it_back(tmp_path, algorithm):
    from trinity_trl.algorithms import resolve_algorithm_config

    config = _config(tmp_path, algorithm=algorithm)
    assert config.beta == 0.0 and config.kl_loss is None and config.kl_penalty is None
    built = config.take_components()
    if algorithm == "dpo":  # Trinity's dpo preset turns 'none' into k2; the config shows it (below)
        assert built.kl_loss.enabled
    else:
        assert not built.kl_loss.enabled and not built.kl_penalty.enabled
        assert not config.resolved_algorithm().needs_reference or "ref_logprob" in built.policy_loss.inputs
    named = _config(tmp_path, algorithm=algorithm, kl_loss="k2").take_components()
    assert (
        named.kl_loss.enabled and named.algorithm.kl_loss == resolve_algorithm_config(algorithm, kl_loss="k2").kl_loss
    )
    if algorithm in PRESETS_WITH_A_TRINITY_KL:  # the old behaviour, exactly, by naming it
        assert named.algorithm.kl_loss == resolve_algorithm_config(algorithm).kl_loss


def test_a_kl_coefficient_without_a_kl_is_refused_and_with_the_presets_kl_it_is_that_kl(tmp_path):
    with pytest.raises(ValueError, match=r"kl_loss sets \['kl_coef'\] but names no KL estimator.*'name': 'k2'"):
        _config(tmp_path, algorithm="asymre", kl_loss={"kl_coef": 0.01})
    with pytest.raises(ValueError, match=r"kl_penalty sets \['kl_coef'\] but names no KL estimator"):
        _config(tmp_path, algorithm="rloo", kl_penalty={"kl_coef": 0.01})
    assert _config(tmp_path, algorithm="grpo", kl_loss={"kl_coef": 0.01}).resolved_algorithm().kl_loss.args == {
        "adaptive": False,
        "kl_coef": 0.01,
    }


def shown_matches_built(config) -> None:
    """What `shown_settings` (the repr, --print_config) says a config trains with is what it builds: each component
    the registry class built from the shown name and arguments, an off component shown as `none`, and the card's
    algorithm table lists exactly the components that are on."""
    import json

    from trinity_trl.algorithms.component import Component
    from trinity_trl.trainers.config import shown_settings
    from trinity_trl.training.model_card import algorithm_card_section

    shown, built = shown_settings(config), config.take_components()
    objects = {
        "policy_loss": (built.policy_loss, POLICY_LOSS_FN),
        "advantage": (built.advantage_fn, ADVANTAGE_FN),
        "kl_loss": (built.kl_loss, KL_FN),
        "kl_penalty": (built.kl_penalty, KL_FN),
        "entropy_loss": (built.entropy_loss, ENTROPY_LOSS_FN),
    }
    card = algorithm_card_section(built.algorithm, type(config).__name__, built)
    for field, (obj, registry) in objects.items():
        if field == "advantage" and not built.algorithm.uses_advantage:
            assert field not in shown and obj is None
            continue
        component = shown[field]
        assert isinstance(component, Component) and f"{field}={component!r}" in repr(config)
        assert type(obj) is registry.get(component.name), (field, component, obj)
        if getattr(obj, "enabled", True):
            assert component == getattr(built.algorithm, field), field  # the arguments it was built from
            if field != "advantage" or built.policy_loss.reads_advantages:
                assert f"| {field} | `{component.name}` | `{json.dumps(component.args, sort_keys=True)}` |" in card
        else:
            assert component == Component("none") and f"| {field} |" not in card
    assert ("No KL term" in card) == (not built.kl_loss.enabled and not built.kl_penalty.enabled)
    assert shown["loss_agg_mode"] == built.algorithm.loss_agg_mode and shown["algorithm"] == config.algorithm


@pytest.mark.parametrize("algorithm", sorted(ALGORITHM_TYPE.names()))
def test_a_bare_config_of_every_preset_shows_what_it_builds(tmp_path, algorithm):
    shown_matches_built(TrinityConfig(algorithm=algorithm, output_dir=str(tmp_path)))
    shown_matches_built(TrinityConfig(algorithm=algorithm, output_dir=str(tmp_path), kl_loss="k3", loss_agg_mode=None))


def test_chord_config_shows_no_kl_and_what_it_builds():
    from trinity_trl.trainers import ChordConfig

    config = ChordConfig()  # TRL users write this: beta=0.0 means no KL
    shown_matches_built(config)
    assert "kl_loss=Component('none')" in repr(config) and not config.take_components().kl_loss.enabled
    assert "mu_peak=0.1" in repr(config)  # the loss's arguments as built, not the unset fields (None)


def test_the_repr_shows_the_options_set_and_trls_fields_changed_from_trls_defaults(tmp_path):
    from trinity_trl.trainers import TrinityDPOConfig, TrinitySFTConfig
    from trinity_trl.trainers.config import changed_trl_fields

    config = _config(tmp_path, algorithm="rloo", learning_rate=3e-4, prefix_packing=False, num_generations=4)
    text = repr(config)
    assert text.startswith("TrinityConfig(algorithm='rloo', policy_loss=Component('ppo', ")
    for part in ("learning_rate=0.0003", "prefix_packing=False", "use_cpu=True", f"output_dir={str(tmp_path)!r}"):
        assert part in text, part
    # TRL's defaults are not repeated (beta=0.0, num_generations=8 is TRL's default... 4 is not)
    assert "beta=" not in text and "num_generations=4" in text and "temperature=" not in text
    assert "epsilon=" not in text  # TrinityConfig's own None (the loss's bound), not a change of TRL's 0.2
    assert changed_trl_fields(GRPOConfig(output_dir="x", use_cpu=True)) == {"output_dir": "x", "use_cpu": True}
    for config_class in (TrinitySFTConfig, TrinityDPOConfig):
        text = repr(_config(tmp_path, config_class))
        assert text.startswith(f"{config_class.__name__}(algorithm=") and "policy_loss=Component(" in text
    assert "kl_loss=Component('k2', adaptive=False, kl_coef=0.001)" in repr(_config(tmp_path, TrinityDPOConfig))


@pytest.mark.parametrize("first, then", [("WARNING", "ERROR"), ("ERROR", "WARNING")])
def test_the_repr_does_not_show_the_progress_bar_setting_transformers_resolves_from_its_logging_level(first, then):
    """``disable_tqdm`` left unset is resolved from transformers' logging level when the config is built; a change of
    that level between two configs (a user's ``set_verbosity_error()``, another test) is not a change the user made.
    CI failed on this: the reference defaults were cached under one level and compared under another."""
    import logging

    from transformers.training_args import logger

    from trinity_trl.trainers.config import changed_trl_fields

    saved = logger.level
    try:
        logger.setLevel(getattr(logging, first))
        changed_trl_fields(GRPOConfig(output_dir="x", use_cpu=True))  # the reference defaults are built (cached)
        logger.setLevel(getattr(logging, then))
        assert changed_trl_fields(GRPOConfig(output_dir="x", use_cpu=True)) == {"output_dir": "x", "use_cpu": True}
        resolved = GRPOConfig(output_dir="x", use_cpu=True).disable_tqdm
        set_against = changed_trl_fields(GRPOConfig(output_dir="x", use_cpu=True, disable_tqdm=not resolved))
        assert set_against == {"output_dir": "x", "disable_tqdm": not resolved, "use_cpu": True}
    finally:
        logger.setLevel(saved)

"""`trinity_trl/trainers/components.py`: the components built from the resolved algorithm's `Component` values, once:
a config builds them when it checks itself and the trainer built from it takes them (issue 37, item 2)."""

from __future__ import annotations

import functools
import pickle
from collections import Counter

import pytest
from datasets import Dataset
from helpers import length_reward, tiny_conversational_dataset, tiny_grpo_kwargs

from trinity_trl.algorithms import ADVANTAGE_FN, ENTROPY_LOSS_FN, KL_FN, POLICY_LOSS_FN
from trinity_trl.algorithms.component import Component
from trinity_trl.trainers import ChordConfig, ChordTrainer, CISPOConfig, CISPOTrainer, TrinityConfig
from trinity_trl.trainers.components import Components


# ------------------------------------------------------------------------------------------------- Components
def test_components_are_built_from_the_resolved_algorithm():
    algorithm = TrinityConfig(
        **tiny_grpo_kwargs(
            output_dir="unused", algorithm="reinforceplusplus", kl_penalty={"name": "k1", "kl_coef": 0.3}
        )
    ).resolved_algorithm()
    components = Components.build(algorithm)
    assert isinstance(components.policy_loss, POLICY_LOSS_FN.get(algorithm.policy_loss.name))
    assert isinstance(components.kl_penalty, KL_FN.get("k1")) and components.kl_penalty.kl_coef == 0.3
    assert isinstance(components.kl_loss, KL_FN.get(algorithm.kl_loss.name))
    assert components.advantage_fn is not None and components.entropy_loss is not None
    assert components.algorithm is algorithm


def test_a_preset_without_advantages_gets_no_advantage_function():
    algorithm = TrinityConfig(**tiny_grpo_kwargs(output_dir="unused", algorithm="raft")).resolved_algorithm()
    assert Components.build(algorithm).advantage_fn is None


def test_trainer_arguments_reach_the_policy_loss():
    algorithm = ChordConfig(**tiny_grpo_kwargs(output_dir="unused")).resolved_algorithm()
    components = Components.build(algorithm, {"usual_sample_weight": 0.125, "expert_sample_weight": 0.5})
    assert components.policy_loss.usual_sample_weight == 0.125
    assert components.policy_loss.expert_sample_weight == 0.5


def test_chord_config_derives_the_sample_weights_from_its_batch_geometry():
    config = ChordConfig(**tiny_grpo_kwargs(output_dir="unused", gradient_accumulation_steps=2, expert_batch_size=2))
    # 4 rollouts a micro-step, 2 micro-steps per generation batch and per optimizer step: w = GA / rows
    rollouts = config.per_device_train_batch_size * config.steps_per_generation
    assert config.derived_policy_loss_arguments() == {
        "usual_sample_weight": 2 / rollouts,
        "expert_sample_weight": 2 / 2,
    }
    loss = config.take_components().policy_loss
    assert (loss.usual_sample_weight, loss.expert_sample_weight) == (2 / rollouts, 1.0)


def test_a_derived_argument_the_user_also_set_is_an_error_when_the_config_is_built():
    user_args = {"usual_sample_weight": 1.0, "expert_sample_weight": 1.0}
    with pytest.raises(
        ValueError,
        match=r"policy_loss sets \['expert_sample_weight', 'usual_sample_weight'\], "
        r"which the trainer derives from its own batch geometry \(would be "
        r"\{'expert_sample_weight': 1.0, 'usual_sample_weight': 0.25\}\); "
        r"remove them",
    ):
        ChordConfig(**tiny_grpo_kwargs(output_dir="unused", policy_loss=user_args))


# ------------------------------------------------------------------------------------------- built once
BUILT: Counter[str] = Counter()


def counted(registry, name: str, base: type) -> type:
    """A subclass of ``base`` registered as ``name`` whose constructor counts its calls (same signature)."""

    @functools.wraps(base.__init__)
    def __init__(self, *args, **kwargs):
        BUILT[name] += 1
        base.__init__(self, *args, **kwargs)

    cls = type(f"Counted{base.__name__}", (base,), {"__init__": __init__})
    registry.register(name)(cls)
    return cls


@pytest.fixture
def counted_components():
    """Counting twins of CISPO's and CHORD's components, registered for one test."""
    registered = [
        (POLICY_LOSS_FN, "counted_cispo", POLICY_LOSS_FN.get("cispo")),
        (POLICY_LOSS_FN, "counted_mix_chord", POLICY_LOSS_FN.get("mix_chord")),
        (ADVANTAGE_FN, "counted_grpo", ADVANTAGE_FN.get("grpo")),
        (KL_FN, "counted_k2", KL_FN.get("k2")),
        (KL_FN, "counted_none", KL_FN.get("none")),
        (ENTROPY_LOSS_FN, "counted_default", ENTROPY_LOSS_FN.get("default")),
        (ENTROPY_LOSS_FN, "counted_mix", ENTROPY_LOSS_FN.get("mix")),
    ]
    for registry, name, base in registered:
        counted(registry, name, base)
    BUILT.clear()
    yield BUILT
    for registry, name, _ in registered:
        registry.unregister(name)


def _counted(policy_loss: str, entropy_loss: str) -> dict:
    return {
        "policy_loss": policy_loss,
        "advantage": "counted_grpo",
        "kl_loss": "counted_k2",
        "kl_penalty": "counted_none",
        "entropy_loss": entropy_loss,
    }


def test_a_cispo_trainer_builds_each_component_once(tmp_path, tiny_model_dir, counted_components):
    args = CISPOConfig(
        **tiny_grpo_kwargs(output_dir=str(tmp_path), max_steps=1),
        **_counted({"name": "counted_cispo", "clip_range_high": 5.0}, "counted_default"),
    )
    assert counted_components == dict.fromkeys(
        ("counted_cispo", "counted_grpo", "counted_k2", "counted_none", "counted_default"), 1
    )  # the config checked its arguments by building them
    trainer = CISPOTrainer(
        model=tiny_model_dir, reward_funcs=length_reward, train_dataset=tiny_conversational_dataset(), args=args
    )
    assert set(counted_components.values()) == {1}  # the trainer took those
    assert trainer.components.policy_loss.clip_range_high == 5.0
    assert trainer.algorithm.policy_loss == Component("counted_cispo", **trainer.algorithm.policy_loss.args)
    # a second trainer from the same config builds its own: no stateful component is shared
    second = CISPOTrainer(
        model=tiny_model_dir, reward_funcs=length_reward, train_dataset=tiny_conversational_dataset(), args=args
    )
    assert set(counted_components.values()) == {2}
    assert second.components.kl_loss is not trainer.components.kl_loss


def test_a_chord_trainer_builds_each_component_once(tmp_path, tiny_model_dir, counted_components):
    args = ChordConfig(
        **tiny_grpo_kwargs(output_dir=str(tmp_path), max_steps=1),
        **_counted("counted_mix_chord", "counted_mix"),
        mu_peak=0.5,
        expert_batch_size=2,
    )
    experts = Dataset.from_list([{"prompt": "What is 1+1?", "completion": "2"}] * 4)
    trainer = ChordTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=tiny_conversational_dataset(),
        expert_dataset=experts,
        args=args,
    )
    assert counted_components == dict.fromkeys(
        ("counted_mix_chord", "counted_grpo", "counted_k2", "counted_none", "counted_mix"), 1
    )
    loss = trainer.components.policy_loss
    assert (
        loss.mu_peak == 0.5
        and loss.expert_sample_weight == args.derived_policy_loss_arguments()["expert_sample_weight"]
    )


def test_a_config_changed_after_its_check_gets_components_that_match_it(counted_components):
    args = CISPOConfig(**tiny_grpo_kwargs(output_dir="unused"), **_counted("counted_cispo", "counted_default"))
    args.policy_loss = Component("counted_cispo", clip_range_high=3.0)
    components = args.take_components()
    assert components.policy_loss.clip_range_high == 3.0 and counted_components["counted_cispo"] == 2
    assert components.built_from(args.resolved_algorithm(), args.derived_policy_loss_arguments())


def test_the_built_components_are_not_pickled_with_the_config():
    # transformers saves the config with torch.save (training_args.bin); a loss class from a user's file need not be
    # importable where it is loaded
    args = TrinityConfig(**tiny_grpo_kwargs(output_dir="unused"))
    restored = pickle.loads(pickle.dumps(args))
    assert "_built_components" not in vars(restored)
    assert restored.take_components().algorithm == args.take_components().algorithm

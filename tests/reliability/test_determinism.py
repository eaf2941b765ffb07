"""Determinism: two runs with the same seed log identical losses and metrics on CPU (and another seed does not)."""

from __future__ import annotations

import math

import pytest
from datasets import Dataset
from helpers import length_reward, tiny_conversational_dataset, tiny_grpo_kwargs

from trinity_trl.rollouts import NumberGuessEnv, number_guess_dataset
from trinity_trl.trainers import (
    ChordConfig,
    ChordTrainer,
    CISPOConfig,
    CISPOTrainer,
    StepGRPOConfig,
    StepGRPOTrainer,
)

WALL_CLOCK_KEYS = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}


def _chord(output_dir, model_dir, seed):
    expert = Dataset.from_list(
        [
            {
                "messages": [
                    {"role": "user", "content": f"What is {a}+{b}?"},
                    {"role": "assistant", "content": f"It is {a + b}."},
                ]
            }
            for a, b in [(1, 2), (3, 4), (5, 6)]
        ]
    )
    args = ChordConfig(
        **tiny_grpo_kwargs(
            output_dir=output_dir,
            max_steps=3,
            seed=seed,
            expert_batch_size=2,
            mu_warmup_steps=1,
            mu_decay_steps=2,
            mu_peak=0.5,
        )
    )
    return ChordTrainer(
        model=model_dir,
        reward_funcs=length_reward,
        args=args,
        expert_dataset=expert,
        train_dataset=tiny_conversational_dataset(),
    )


def _cispo(output_dir, model_dir, seed):
    args = CISPOConfig(
        **tiny_grpo_kwargs(
            output_dir=output_dir, max_steps=3, seed=seed, gradient_accumulation_steps=2, per_device_train_batch_size=2
        )
    )
    return CISPOTrainer(
        model=model_dir, reward_funcs=length_reward, args=args, train_dataset=tiny_conversational_dataset()
    )


def _step_grpo(output_dir, model_dir, seed):
    args = StepGRPOConfig(**tiny_grpo_kwargs(output_dir=output_dir, max_steps=3, seed=seed, max_env_steps=3))
    return StepGRPOTrainer(
        model=model_dir,
        args=args,
        train_dataset=number_guess_dataset(16),
        environment_factory=lambda: NumberGuessEnv(partial_credit=True),
    )


def _logs(trainer) -> list[dict]:
    return [{k: v for k, v in h.items() if k not in WALL_CLOCK_KEYS} for h in trainer.state.log_history]


def _nan_equal(a: list[dict], b: list[dict]) -> bool:
    """Exact equality of two log histories, NaN equal to NaN."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if set(x) != set(y):
            return False
        for key in x:
            u, v = x[key], y[key]
            if not (u == v or (isinstance(u, float) and isinstance(v, float) and math.isnan(u) and math.isnan(v))):
                return False
    return True


@pytest.mark.parametrize("build", [_chord, _cispo, _step_grpo], ids=["chord", "cispo", "step_grpo"])
def test_same_seed_same_losses(tmp_path, tiny_model_dir, build):
    runs = []
    for name, seed in (("a", 0), ("b", 0), ("other_seed", 1)):
        trainer = build(str(tmp_path / name), tiny_model_dir, seed)
        trainer.train()
        runs.append(_logs(trainer))
    first, second, other = runs
    assert len([h for h in first if "loss" in h]) == 3
    assert _nan_equal(first, second), "two runs with the same seed logged different values"
    # the comparison has power: another seed samples other completions, hence other losses
    assert [h.get("loss") for h in first] != [h.get("loss") for h in other]

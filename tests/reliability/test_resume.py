"""Checkpoint and resume: a run stopped at step k and resumed from its checkpoint logs, from step k + 1 on, the same
losses and metrics (within 1e-6) as the uninterrupted run, on CPU with a fixed seed.

What must survive a checkpoint beyond TRL's own state (model, optimizer, scheduler, RNG, `trainer_state.json`) is in
`trinity_trainer_state.json`: the KL controllers (adaptive coefficient), the CHORD expert-stream position, the
generation counter and TRL's micro-step counter; a checkpoint taken in the middle of a generation batch
(`num_iterations > 1`) also keeps each process's remaining batch (`trinity_generation_buffer_rank*.pt`). The μ
schedule is a function of `global_step`, which `trainer_state.json` restores.
"""

from __future__ import annotations

import math
import os

import torch
from datasets import Dataset
from helpers import length_reward, tiny_conversational_dataset, tiny_grpo_kwargs
from tolerance import approx

from trinity_trl.checkpointing.checkpoints import BUFFER_FILE, TRAINER_STATE_FILE
from trinity_trl.rollouts import NumberGuessEnv, number_guess_dataset
from trinity_trl.trainers import (
    ChordConfig,
    ChordTrainer,
    StepGRPOConfig,
    StepGRPOTrainer,
    TrinityConfig,
    TrinityTrainer,
)

STEPS, STOP = 4, 2
WALL_CLOCK_KEYS = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}


def _chord(output_dir, model_dir, **extra):
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
    # μ warms up over 2 steps and decays over 2: μ = 0.3, 0.6, 0.35, 0.1 at steps 1..4
    args = ChordConfig(
        **tiny_grpo_kwargs(
            output_dir=output_dir,
            max_steps=STEPS,
            expert_batch_size=2,
            mu_warmup_steps=2,
            mu_decay_steps=2,
            mu_peak=0.6,
            mu_valley=0.1,
            **extra,
        )
    )
    return ChordTrainer(
        model=model_dir,
        reward_funcs=length_reward,
        args=args,
        expert_dataset=expert,
        train_dataset=tiny_conversational_dataset(),
    )


def _adaptive_kl(output_dir, model_dir, **extra):
    args = TrinityConfig(
        **tiny_grpo_kwargs(
            output_dir=output_dir,
            max_steps=STEPS,
            algorithm="reinforceplusplus",
            kl_penalty={"name": "k2", "kl_coef": 0.1, "adaptive": True, "target_kl": 1e-6, "horizon": 10},
            **extra,
        )
    )
    return TrinityTrainer(
        model=model_dir, reward_funcs=length_reward, args=args, train_dataset=tiny_conversational_dataset()
    )


def _step_grpo(output_dir, model_dir, **extra):
    args = StepGRPOConfig(**tiny_grpo_kwargs(output_dir=output_dir, max_steps=STEPS, max_env_steps=3, **extra))
    return StepGRPOTrainer(
        model=model_dir,
        args=args,
        train_dataset=number_guess_dataset(16),
        environment_factory=lambda: NumberGuessEnv(partial_credit=True),
    )


def _mid_generation(output_dir, model_dir, **extra):
    # each generation batch is trained on for 2 optimizer steps: a checkpoint at step 1 is taken mid-batch
    args = TrinityConfig(**tiny_grpo_kwargs(output_dir=output_dir, max_steps=STEPS, num_iterations=2, **extra))
    return TrinityTrainer(
        model=model_dir, reward_funcs=length_reward, args=args, train_dataset=tiny_conversational_dataset()
    )


def _step_logs(trainer) -> dict[int, dict]:
    return {h["step"]: h for h in trainer.state.log_history if "loss" in h}


def _assert_same_logs(straight: dict, resumed: dict, steps) -> None:
    for step in steps:
        a, b = straight[step], resumed[step]
        keys = (set(a) | set(b)) - WALL_CLOCK_KEYS
        assert set(a) - WALL_CLOCK_KEYS == set(b) - WALL_CLOCK_KEYS, (step, set(a) ^ set(b))
        for key in sorted(keys):
            x, y = a[key], b[key]
            if isinstance(x, float) and math.isnan(x):
                assert isinstance(y, float) and math.isnan(y), (step, key, x, y)
            else:
                # the resumed run replays the same kernels on weights, optimizer and RNG states restored bit for bit;
                # what remains is the logged average of at most 8 micro-batch values (float32)
                assert y == approx(x, terms=8, scale=max(1.0, abs(x))), (
                    f"step {step}, {key}: uninterrupted {x}, resumed {y}"
                )


def _stop_and_resume(tmp_path, model_dir, build, stop=STOP):
    straight = build(str(tmp_path / "straight"), model_dir, save_strategy="steps", save_steps=stop)
    straight.train()
    checkpoint = tmp_path / "straight" / f"checkpoint-{stop}"
    resumed = build(str(tmp_path / "resumed"), model_dir)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    straight_logs, resumed_logs = _step_logs(straight), _step_logs(resumed)
    assert sorted(resumed_logs) == sorted(straight_logs) == list(range(1, STEPS + 1))
    _assert_same_logs(straight_logs, resumed_logs, range(stop + 1, STEPS + 1))
    return straight, resumed, checkpoint


def test_chord_resume_continues_the_mu_schedule_and_the_expert_stream(tmp_path, tiny_model_dir):
    straight, resumed, _ = _stop_and_resume(tmp_path, tiny_model_dir, _chord)
    mu = [h["actor/mu"] for h in straight.state.log_history if "actor/mu" in h]
    assert mu == approx([0.3, 0.6, 0.35, 0.1])  # the schedule's few float32 operations
    assert resumed._expert_cursor == straight._expert_cursor == 2 * STEPS


def test_adaptive_kl_coefficient_resume(tmp_path, tiny_model_dir):
    straight, resumed, _ = _stop_and_resume(tmp_path, tiny_model_dir, _adaptive_kl)
    coefs = [h["critic/kl_coef"] for h in straight.state.log_history if "critic/kl_coef" in h]
    assert len(set(coefs)) == STEPS  # the coefficient moves every step, so a reset would show
    assert resumed.components.kl_penalty.kl_coef == approx(
        straight.components.kl_penalty.kl_coef, dtype=torch.float64, terms=STEPS
    )  # Python floats, one product per step


def test_step_grpo_resume(tmp_path, tiny_model_dir):
    """Environments are created per run from the dataset row, so nothing of them needs saving; the sampler order and
    the RNG (restored by transformers) make the resumed runs play the same games with the same samples."""
    straight, _, _ = _stop_and_resume(tmp_path, tiny_model_dir, _step_grpo)
    logs = _step_logs(straight)
    assert any(logs[s]["multi_step/steps_per_run"] > 1 for s in logs)


def test_resume_in_the_middle_of_a_generation_batch(tmp_path, tiny_model_dir):
    """With num_iterations=2 a checkpoint at step 1 falls inside a generation batch: the resumed run must train step 2
    on the saved batch (TRL alone would generate a new one and shift every later generation)."""
    straight, resumed, checkpoint = _stop_and_resume(tmp_path, tiny_model_dir, _mid_generation, stop=1)
    assert os.path.isfile(checkpoint / BUFFER_FILE.format(rank=0))
    # no buffer in a checkpoint taken at a generation boundary
    assert not os.path.isfile(tmp_path / "straight" / "checkpoint-2" / BUFFER_FILE.format(rank=0))
    logs = _step_logs(straight)
    # TRL logs generation metrics only at steps that generate: 1 and 3, in both runs
    assert ["num_tokens" in logs[s] for s in range(1, STEPS + 1)] == [True, False, True, False]
    assert ["num_tokens" in h for h in _step_logs(resumed).values()] == [True, False, True, False]


def test_resume_restores_the_adaptive_kl_coefficient_and_writes_the_trainer_state(tmp_path, tiny_model_dir):
    """The resumed run ends with the same adaptive β as the uninterrupted one, read from the checkpoint's
    trinity_trainer_state.json."""

    def run(**extra):
        args = {"kl_coef": 0.1, "adaptive": True, "target_kl": 1e-6, "horizon": 10}
        return TrinityTrainer(
            model=tiny_model_dir,
            reward_funcs=length_reward,
            train_dataset=tiny_conversational_dataset(),
            args=TrinityConfig(
                **tiny_grpo_kwargs(
                    output_dir=str(tmp_path / "out"),
                    algorithm="reinforceplusplus",
                    kl_penalty={"name": "k2", **args},
                    max_steps=3,
                    save_strategy="steps",
                    save_steps=1,
                    **extra,
                )
            ),
        )

    straight = run()
    straight.train()
    resumed = run()
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    # Python floats, one product per step
    assert resumed.components.kl_penalty.kl_coef == approx(
        straight.components.kl_penalty.kl_coef, dtype=torch.float64, terms=STEPS
    )
    assert (tmp_path / "out" / "checkpoint-2" / TRAINER_STATE_FILE).is_file()

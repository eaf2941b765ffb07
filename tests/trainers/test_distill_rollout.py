"""On-policy distillation with teacher log-probs that arrive with the rollout (issue 13 item 10): a `rollout_func`
returning `teacher_logprobs`, as Trinity's workflows store them, instead of a `teacher_model`."""

from __future__ import annotations

import pytest
import torch
from helpers import TINY_LOGP_SCALE, TINY_MODEL_TERMS, length_reward, tiny_conversational_dataset, tiny_grpo_kwargs
from tolerance import assert_close

from trinity_trl.trainers import TrinityConfig, TrinityTrainer

G = 4


def scripted_rollout(prompts, trainer):
    """Fixed completions of 3 tokens and teacher log-probs -0.1, -0.2, -0.3 (+ row / 100)."""
    prompt_ids = trainer.generation.tokenize_conversations(prompts)
    eos = trainer.generation.eos_token_id
    completions = [[5 + i % 3, 6, eos] for i in range(len(prompts))]
    teacher = [[-0.1 - i / 100, -0.2 - i / 100, -0.3 - i / 100] for i in range(len(prompts))]
    return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": None, "teacher_logprobs": teacher}


def make(tmp_path, tiny_model_dir, rollout_func, **kwargs):
    return TrinityTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=tiny_conversational_dataset(),
        rollout_func=rollout_func,
        args=TrinityConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path), algorithm="on_policy_distill")),
        **kwargs,
    )


def test_teacher_logprobs_from_the_rollout_give_the_distillation_advantages(tmp_path, tiny_model_dir):
    trainer = make(tmp_path, tiny_model_dir, scripted_rollout)  # no teacher_model
    trainer.model.train()
    rows = [dict(tiny_conversational_dataset()[0]) for _ in range(G)]
    batch = trainer._generate_and_score_completions(rows)
    behaviour = trainer.scoring.logps(trainer.model, batch)
    teacher = torch.tensor([[-0.1 - i / 100, -0.2 - i / 100, -0.3 - i / 100] for i in range(G)])
    expected = (teacher - behaviour) * batch["completion_mask"]  # kl_coef 1.0: A = ℓτ − ℓo on completion tokens
    # the behaviour log-probs of the batch and of this second forward (the tiny model's chain), minus fixed values
    assert_close(batch["advantages"], expected, terms=TINY_MODEL_TERMS, scale=TINY_LOGP_SCALE)


def test_without_a_teacher_model_or_rollout_logprobs_the_error_says_what_to_give(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match="needs a teacher_model .* or a rollout_func that returns 'teacher_logprobs'"):
        TrinityTrainer(
            model=tiny_model_dir,
            reward_funcs=length_reward,
            train_dataset=tiny_conversational_dataset(),
            args=TrinityConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path), algorithm="on_policy_distill")),
        )

    def without_teacher(prompts, trainer):
        out = scripted_rollout(prompts, trainer)
        del out["teacher_logprobs"]
        return out

    trainer = make(tmp_path, tiny_model_dir, without_teacher)
    trainer.model.train()
    with pytest.raises(ValueError, match="pass teacher_model=, or return 'teacher_logprobs'"):
        trainer._generate_and_score_completions([dict(tiny_conversational_dataset()[0]) for _ in range(G)])


def test_teacher_logprobs_of_the_wrong_length_are_an_error(tmp_path, tiny_model_dir):
    def short(prompts, trainer):
        out = scripted_rollout(prompts, trainer)
        out["teacher_logprobs"] = [row[:1] for row in out["teacher_logprobs"]]
        return out

    trainer = make(tmp_path, tiny_model_dir, short)
    trainer.model.train()
    with pytest.raises(ValueError, match="returned 1 teacher_logprobs for row 0, whose completion has 3 tokens"):
        trainer._generate_and_score_completions([dict(tiny_conversational_dataset()[0]) for _ in range(G)])

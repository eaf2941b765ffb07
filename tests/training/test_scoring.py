"""The extra passes of `trinity_trl/training/scoring.py` (`Scoring`, the trainer's `scoring`): log-probs of any rows
under the policy, the reference and the teacher, and behaviour log-probs computed once. ReMax's greedy baselines are
tested in `test_remax.py`, teacher log-probs arriving with a rollout in `test_distill_rollout.py`, the packed forwards
of these passes in `tests/packing/test_forward.py`."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    TINY_LOGP_SCALE,
    TINY_MODEL_TERMS,
    generate_batch,
    length_reward,
    policy_logps,
    tiny_conversational_dataset,
    tiny_grpo_kwargs,
)
from tolerance import assert_close

from trinity_trl.trainers import TrinityConfig, TrinityTrainer
from trinity_trl.training.scoring import Scoring


def make(tmp_path, model, **config):
    args = TrinityConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path), **config))
    return TrinityTrainer(
        model=model, reward_funcs=length_reward, train_dataset=tiny_conversational_dataset(), args=args
    )


def rows_of(batch: dict) -> dict:
    return {k: batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}


def test_forward_logps_are_the_policy_logps_without_a_graph(tmp_path, tiny_model_dir):
    trainer = make(tmp_path, tiny_model_dir)
    batch = generate_batch(trainer, tiny_conversational_dataset())
    logps = trainer.scoring.logps(trainer.model, rows_of(batch))
    assert not logps.requires_grad
    assert logps.shape == batch["completion_ids"].shape
    mask = batch["completion_mask"].bool()
    # the same weights through another call (batch layout): the tiny model's chain, at a log-prob's magnitude
    assert_close(logps[mask], policy_logps(trainer, batch)[mask], terms=TINY_MODEL_TERMS, scale=TINY_LOGP_SCALE)


def test_behaviour_logps_are_computed_once_and_kept_in_the_batch(tmp_path, tiny_model_dir):
    trainer = make(tmp_path, tiny_model_dir)
    batch = rows_of(generate_batch(trainer, tiny_conversational_dataset()))
    first = trainer.scoring.behaviour_logps(batch)
    assert batch["old_per_token_logps"] is first
    with torch.no_grad():  # the policy changes: the batch keeps the log-probs it was sampled with
        for p in trainer.model.parameters():
            p.add_(0.05)
    assert trainer.scoring.behaviour_logps(batch) is first
    given = {**batch, "old_per_token_logps": torch.full_like(first, -1.5)}  # TRL's own are used as they are
    assert torch.equal(trainer.scoring.behaviour_logps(given), torch.full_like(first, -1.5))  # passed through, a copy


def test_reference_logps_come_from_the_reference_model_not_the_trained_policy(tmp_path, tiny_model_dir):
    trainer = make(tmp_path, tiny_model_dir, kl_loss={"name": "k2", "kl_coef": 0.1})
    assert trainer.ref_model is not None
    batch = rows_of(generate_batch(trainer, tiny_conversational_dataset()))
    before = trainer.scoring.reference_logps(batch)
    # a reference model holding the same weights: the tiny model's chain, at a log-prob's magnitude
    assert_close(before, trainer.scoring.logps(trainer.model, batch), terms=TINY_MODEL_TERMS, scale=TINY_LOGP_SCALE)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.mul_(1.1)
    # exact: the untouched reference model, the same kernels on the same batch
    assert torch.equal(trainer.scoring.reference_logps(batch), before)
    mask = batch["completion_mask"].bool()
    assert (trainer.scoring.logps(trainer.model, batch) - before)[mask].abs().max() > 1e-3


def test_teacher_logps_without_teacher_or_rollout_values_say_what_to_pass(tmp_path, tiny_model_dir):
    trainer = make(tmp_path, tiny_model_dir)
    batch = rows_of(generate_batch(trainer, tiny_conversational_dataset()))
    with pytest.raises(ValueError, match="teacher_model=.*teacher_logprobs"):
        trainer.scoring.teacher_logps(batch, [{} for _ in range(batch["completion_ids"].size(0))])
    rows = [
        {"teacher_logprobs": [-0.5] * batch["completion_ids"].size(1)} for _ in range(batch["completion_ids"].size(0))
    ]
    teacher = trainer.scoring.teacher_logps(batch, rows)
    mask = batch["completion_mask"].bool()
    assert torch.all(teacher[mask] == -0.5)


def standalone_scoring(forward, teacher=None) -> Scoring:
    """A Scoring built from what it is given alone (no trainer): a forward, a policy, no reference."""
    policy = torch.nn.Linear(1, 1)
    return Scoring(
        forward=forward,
        batch_size=3,
        policy=lambda: policy,
        reference=None,
        unwrap=lambda model: model,
        teacher=teacher,
        generation=None,
        score=None,
        reward_weights=torch.ones(1),
    )


def test_scoring_needs_only_what_it_is_given():
    calls = []

    def forward(model, input_ids, attention_mask, logits_to_keep, batch_size=None, **multimodal):
        calls.append((model, input_ids.shape, logits_to_keep, batch_size, sorted(multimodal)))
        return torch.full((input_ids.shape[0], logits_to_keep), -0.5), None, None

    scoring = standalone_scoring(forward)
    rows = {
        "prompt_ids": torch.ones(2, 3, dtype=torch.long),
        "prompt_mask": torch.ones(2, 3, dtype=torch.long),
        "completion_ids": torch.ones(2, 4, dtype=torch.long),
        "completion_mask": torch.ones(2, 4, dtype=torch.long),
    }
    batch = dict(rows)
    assert scoring.behaviour_logps(batch).tolist() == [[-0.5] * 4] * 2
    scoring.behaviour_logps(batch)  # kept in the batch: no second forward
    assert calls == [(scoring.policy(), (2, 7), 4, 3, [])]
    with pytest.raises(ValueError, match="teacher_model="):
        scoring.teacher_logps(rows, [{}, {}])
    teacher = torch.nn.Linear(1, 1)
    assert standalone_scoring(forward, teacher).teacher_logps(rows, [{}, {}]).shape == (2, 4)
    assert calls[-1][0] is teacher

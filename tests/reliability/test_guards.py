"""Numerical guards: no NaN or inf reaches the optimizer from the loss code, and each guard that fires is counted.

`TrinityTrainer._compute_loss` (so every trainer) drops trained tokens whose log-probs (current, behaviour,
reference), entropies, advantages or vLLM importance weights are not finite, zeroes every untrained position before
the loss (so an inf in padding cannot become a 0·inf = NaN gradient), and replaces a loss that is still not finite by
an exact zero. Logged counts since the previous log line: `guards/nonfinite_logps`, `guards/nonfinite_advantages`
(tokens), `guards/empty_mask`, `guards/nonfinite_loss` (micro-batches).

The guard functions themselves on tensors: `guard_loss_mask` in tests/training/test_checks.py, `masked_finite` in
tests/training/test_loss.py.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers import length_reward, tiny_conversational_dataset, tiny_grpo_kwargs
from transformers import TrainerCallback

from trinity_trl.trainers import (
    ChordConfig,
    ChordTrainer,
    SAPOConfig,
    SAPOTrainer,
    TrinityConfig,
    TrinityTrainer,
)
from trinity_trl.training import checks
from trinity_trl.training import loss as loss_module
from trinity_trl.training.checks import GUARD_METRICS


class GradRecorder(TrainerCallback):
    """Every gradient the optimizer is about to use (flattened), and whether all were finite."""

    def __init__(self):
        self.grads = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append(
            torch.cat(
                [
                    (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).clone()
                    for p in model.parameters()
                    if p.requires_grad
                ]
            )
        )


def _injecting(cls):
    """`cls` whose generation batches get non-finite values: row 1's last two tokens become padding (mask 0) with
    -inf behaviour log-probs there, row 0's first token a NaN behaviour log-prob, row 2 a NaN advantage."""

    class Injecting(cls):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            assert out["completion_mask"][:4].all(), "the random model never stops early: full rows expected"
            out["completion_mask"][1, -2:] = 0
            out["old_per_token_logps"][1, -2:] = -torch.inf  # untrained: must not leak
            out["old_per_token_logps"][0, 0] = torch.nan  # trained: dropped and counted
            out["advantages"][2] = torch.nan  # 8 trained tokens dropped and counted
            return out

    return Injecting


def _sapo(tmp_path, model_dir, cls=SAPOTrainer, **overrides):
    # num_iterations=2: TRL computes behaviour log-probs, and each batch is trained on twice
    args = SAPOConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path / "out"), num_iterations=2, **overrides))
    grads = GradRecorder()
    trainer = cls(
        model=model_dir,
        reward_funcs=length_reward,
        args=args,
        train_dataset=tiny_conversational_dataset(),
        callbacks=[grads],
    )
    return trainer, grads


def _train_logs(trainer):
    return [h for h in trainer.state.log_history if "loss" in h]


def test_nonfinite_inputs_give_finite_loss_and_gradients_and_are_counted(tmp_path, tiny_model_dir):
    trainer, grads = _sapo(tmp_path, tiny_model_dir, cls=_injecting(SAPOTrainer))
    trainer.train()
    logs = _train_logs(trainer)
    assert len(logs) == 2 and len(grads.grads) == 2
    for log, grad in zip(logs, grads.grads):
        assert math.isfinite(log["loss"]) and math.isfinite(log["grad_norm"]) and log["grad_norm"] > 0
        assert torch.isfinite(grad).all()
        assert log["guards/nonfinite_logps"] == 1.0
        assert log["guards/nonfinite_advantages"] == 8.0
        assert log["guards/empty_mask"] == 0.0 and log["guards/nonfinite_loss"] == 0.0


def test_without_the_guards_the_same_inputs_poison_the_gradient(tmp_path, tiny_model_dir, monkeypatch):
    """The test above has power: with the guards switched off, SAPO's soft gate turns the -inf in padding into a NaN
    gradient (0 · σ'(∞) · ∞), and the NaN behaviour log-prob into a NaN loss."""
    monkeypatch.setattr(checks, "guard_loss_mask", lambda mask, *a: (mask, {}))
    monkeypatch.setattr(loss_module, "masked_finite", lambda value, mask: value)
    monkeypatch.setattr(checks, "is_finite", lambda x: True)
    trainer, grads = _sapo(tmp_path, tiny_model_dir, cls=_injecting(SAPOTrainer), max_steps=1)
    trainer.train()
    assert not torch.isfinite(grads.grads[0]).all()


def test_nonfinite_loss_is_replaced_by_zero_and_counted(tmp_path, tiny_model_dir):
    """A loss that overflows (here: forced to inf) skips the micro-batch: zero gradient, unchanged parameters."""

    class Overflowing(SAPOTrainer):
        def _policy_loss_for(self, mode):
            loss_fn = copy.copy(super()._policy_loss_for(mode))
            token_losses = loss_fn.token_losses

            def overflowing(**inputs):
                values, metrics = token_losses(**inputs)
                return values * torch.inf, metrics

            loss_fn.token_losses = overflowing
            return loss_fn

    trainer, grads = _sapo(tmp_path, tiny_model_dir, cls=Overflowing, max_steps=1)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    log = _train_logs(trainer)[0]
    assert log["guards/nonfinite_loss"] == 1.0 and log["loss"] == 0.0
    assert torch.count_nonzero(grads.grads[0]) == 0
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


@pytest.mark.parametrize("algorithm", ["grpo", "reinforceplusplus"])
@pytest.mark.parametrize("normalization", ["micro_batch", "global"])
def test_all_completions_masked_give_zero_loss_and_count_empty_masks(
    tmp_path, tiny_model_dir, algorithm, normalization
):
    """mask_truncated_completions with a model that never emits EOS: every completion is masked, so every micro-batch
    has an empty loss mask; the loss is exactly 0 with a zero gradient (REINFORCE++'s whitening, which needs two
    tokens, is skipped instead of failing)."""
    grads = GradRecorder()
    args = TrinityConfig(
        **tiny_grpo_kwargs(
            output_dir=str(tmp_path / "out"),
            algorithm=algorithm,
            max_steps=1,
            loss_normalization=normalization,
            mask_truncated_completions=True,
            gradient_accumulation_steps=2,
            per_device_train_batch_size=2,
        )
    )
    trainer = TrinityTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        args=args,
        train_dataset=tiny_conversational_dataset(),
        callbacks=[grads],
    )
    trainer.train()
    log = _train_logs(trainer)[0]
    assert log["completions/clipped_ratio"] == 1.0
    assert log["loss"] == 0.0 and log["guards/empty_mask"] == 2.0  # both micro-batches of the step
    assert torch.count_nonzero(grads.grads[0]) == 0


def test_guard_metrics_are_logged_as_zero_counts_in_a_normal_run(tmp_path, tiny_model_dir):
    expert = tiny_conversational_dataset(4).map(lambda row: {"completion": "It is " + row["answer"]})
    trainer = ChordTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        expert_dataset=expert,
        args=ChordConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path / "out"), expert_batch_size=2)),
        train_dataset=tiny_conversational_dataset(),
    )
    trainer.train()
    for log in _train_logs(trainer):
        assert {k: log[k] for k in GUARD_METRICS} == dict.fromkeys(GUARD_METRICS, 0.0)

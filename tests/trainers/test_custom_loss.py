"""A loss is one file plus its test (issue 12 item 2): policy losses defined here, outside the package, registered
with `POLICY_LOSS_FN.register`, are trained by the trainers with no other change, and each is treated as its
declared properties say (docs/algorithms/custom-components.md)."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from helpers import length_reward, tiny_conversational_dataset, tiny_grpo_kwargs

from trinity_trl.algorithms import POLICY_LOSS_FN, PolicyLossFn, masked_mean
from trinity_trl.rollouts import Environment, StepResult
from trinity_trl.trainers import StepGRPOConfig, StepGRPOTrainer, TrinityConfig, TrinityTrainer


class ClippedReinforce(PolicyLossFn):
    """``-clamp(A, -c, c) · ℓ``: REINFORCE with clipped advantages. Clipping at ``c`` makes it non-linear in A."""

    def __init__(self, backend: str = "trl", clip: float = 1.0):
        super().__init__(backend)
        self.clip = float(clip)

    @property
    def linear_in_advantage(self) -> bool:
        return False

    def token_losses(self, logprob, advantages, **_):
        return -advantages.clamp(-self.clip, self.clip) * logprob, {}


class SequenceRatioReinforce(PolicyLossFn):
    """``-A · exp(mean_row(ℓ − ℓo)) · ...``: a per-row (sequence-level) ratio, like GSPO."""

    @property
    def sequence_level(self) -> bool:
        return True

    loss_metric = "sequence_loss"

    def token_losses(self, logprob, old_logprob, action_mask, advantages, **_):
        ratio = torch.exp(masked_mean(logprob - old_logprob, action_mask, dim=-1)).unsqueeze(-1)
        return -advantages * ratio * logprob, {}


@pytest.fixture
def registered():
    POLICY_LOSS_FN.register("clipped_reinforce")(ClippedReinforce)
    POLICY_LOSS_FN.register("sequence_reinforce")(SequenceRatioReinforce)
    yield
    POLICY_LOSS_FN.unregister("clipped_reinforce")
    POLICY_LOSS_FN.unregister("sequence_reinforce")


def test_a_user_loss_trains_in_trinity_trainer(tmp_path, tiny_model_dir, registered):
    args = TrinityConfig(
        **tiny_grpo_kwargs(output_dir=str(tmp_path), policy_loss={"name": "clipped_reinforce", "clip": 0.5})
    )
    trainer = TrinityTrainer(
        model=tiny_model_dir, reward_funcs=length_reward, train_dataset=tiny_conversational_dataset(), args=args
    )
    assert isinstance(trainer.components.policy_loss, ClippedReinforce) and trainer.components.policy_loss.clip == 0.5
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "actor/clipped_reinforce_loss" in entry]
    assert len(logged) == 2  # its metrics reach the logs
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def test_a_loss_that_is_not_linear_in_the_advantage_refuses_vllm_importance_weights(
    tmp_path, tiny_model_dir, registered
):
    """TRL's vLLM importance-sampling weight is applied through the advantages, which is exact only for a loss linear
    in them; the trainer asks the loss and refuses at construction (before vLLM is touched)."""

    def build(loss):
        return TrinityTrainer(
            model=tiny_model_dir,
            reward_funcs=length_reward,
            train_dataset=tiny_conversational_dataset(),
            args=TrinityConfig(
                **tiny_grpo_kwargs(
                    output_dir=str(tmp_path),
                    policy_loss=loss,
                    use_vllm=True,
                    vllm_importance_sampling_correction=True,
                )
            ),
        )

    with pytest.raises(ValueError, match="'clipped_reinforce' with these arguments is not linear in the advantage"):
        build("clipped_reinforce")
    with pytest.raises(Exception) as linear:  # a linear loss passes our check; TRL then needs vLLM, absent here
        build("sequence_reinforce")
    assert "not linear in the advantage" not in str(linear.value)


class CountingEnv(Environment):
    """Runs of 1-3 turns with different rewards, so every task group has a spread."""

    counter = 0

    def reset(self, **row):
        CountingEnv.counter += 1
        self.turns, self.reward, self.seen = 1 + CountingEnv.counter % 3, float(CountingEnv.counter % 5), 0
        return "Say something."

    def step(self, action):
        self.seen += 1
        done = self.seen >= self.turns
        return StepResult(None if done else "Go on.", reward=self.reward if done else 0.0, done=done)


@pytest.mark.parametrize("loss, rows_are_runs", [("clipped_reinforce", True), ("sequence_reinforce", False)])
def test_step_grpo_packs_runs_only_for_token_level_losses(tmp_path, tiny_model_dir, registered, loss, rows_are_runs):
    """A sequence-level loss would mix the turns of a run packed in one row, so StepGRPO falls back to one row per
    turn for it; a token-level loss trains each run as one row."""
    batches = []

    class Recording(StepGRPOTrainer):
        def _step_batch(self, output, runs, advantages):
            batch = super()._step_batch(output, runs, advantages)
            batches.append((len(runs), sum(len(r.steps) for r in runs), int((batch["sample_count"] > 0).sum())))
            return batch

    CountingEnv.counter = 0
    trainer = Recording(
        model=tiny_model_dir,
        environment_factory=CountingEnv,
        train_dataset=Dataset.from_dict({"task": list(range(8))}),
        args=StepGRPOConfig(
            **tiny_grpo_kwargs(
                output_dir=str(tmp_path), max_steps=1, max_env_steps=3, policy_loss=loss, shared_prefix=True
            )
        ),
    )
    trainer.train()
    runs, steps, rows = batches[0]
    assert steps > runs  # some runs have several turns, so the two layouts differ
    assert rows == (runs if rows_are_runs else steps)

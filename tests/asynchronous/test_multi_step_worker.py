"""MultiStepWorker (AsyncStepGRPOTrainer's worker): a group is num_generations runs of one task, each step a sample
whose prompt is the conversation so far, trained on its completion only, with the log-probs it was sampled with and
its run's step-wise GRPO advantage (the spec's formula, computed here by hand)."""

from __future__ import annotations

import math

import pytest
import torch
from async_helpers import recomputed_logps, send
from datasets import Dataset
from helpers import TINY_MODEL_TERMS, build_tiny_model, build_tiny_tokenizer
from tolerance import assert_close

from trinity_trl.algorithms import ADVANTAGE_FN
from trinity_trl.asynchronous.multi_step_worker import MultiStepWorker
from trinity_trl.asynchronous.worker import GroupScorer
from trinity_trl.rollouts import Environment, MultiStepRollout, StepResult
from trinity_trl.rollouts.protocols import environment_reward

G = 4
TURNS = [1, 2, 3, 2]  # run i ends after TURNS[i] turns
FINAL = [1.0, 0.0, None, 2.0]  # run i's last-step reward (None: the environment cannot score it)


class Scripted(Environment):
    """Run i (in the order the environments are built) takes ``TURNS[i]`` turns and ends with ``FINAL[i]``."""

    built = 0

    def reset(self, **row):
        self.index, self.turn = Scripted.built % G, 0
        Scripted.built += 1
        return "start"

    def step(self, action: str) -> StepResult:
        self.turn += 1
        done = self.turn >= TURNS[self.index]
        return StepResult(None if done else f"turn {self.turn}", reward=FINAL[self.index] if done else 0.5, done=done)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def make_worker(
    tokenizer, max_env_steps: int = 3, advantage: str = "step_wise_grpo", **advantage_args
) -> MultiStepWorker:
    Scripted.built = 0
    advantage = ADVANTAGE_FN.get(advantage)(**advantage_args)
    # the worker scores runs with the reward functions and the step-wise component, never the group estimator
    scorer = GroupScorer([environment_reward], ["environment_reward"], torch.ones(1), estimator=None)
    return MultiStepWorker(
        build_tiny_model(tokenizer, seed=0),
        tokenizer,
        Dataset.from_dict({"prompt": [[{"role": "user", "content": "play"}]]}),
        scorer,
        num_generations=G,
        max_completion_length=5,
        temperature=0.7,
        eos_token_ids=[tokenizer.eos_token_id],
        rollout=MultiStepRollout(None, Scripted, max_env_steps, "tokens"),
        advantage_fn=advantage,
    )


def by_run(samples) -> list[list]:
    """The samples of each run, in order (a run's steps are queued together, in turn order)."""
    runs, start = [], 0
    for turns in TURNS:
        runs.append(samples[start : start + turns])
        start += turns
    return runs


def test_every_step_is_a_sample_with_its_prompt_its_completion_and_its_sampled_logprobs(tokenizer):
    worker = make_worker(tokenizer)
    policy = build_tiny_model(tokenizer, seed=7)
    send(worker, policy, version=2)
    worker._load_committed()
    torch.manual_seed(0)
    samples, metrics = worker.rollout_group(position=5)
    assert len(samples) == sum(TURNS)
    assert {s.model_version for s in samples} == {2} and {s.group_id for s in samples} == {5}
    for run in by_run(samples):
        for earlier, later in zip(run, run[1:]):
            # history="tokens": a turn's prompt extends the previous turn's prompt and completion
            assert later.input_ids.tolist()[: len(earlier.input_ids)] == earlier.input_ids.tolist()
        for sample in run:
            mask = sample.completion_mask.tolist()
            start = mask.index(1) if 1 in mask else len(mask)
            assert set(mask[:start]) <= {0} and len(mask) == len(sample.input_ids)
    for sample in samples:
        if sample.completion_mask.sum():  # the log-probs the step was sampled with, under the weights of version 2
            assert_close(
                torch.tensor(sample.old_log_probs[sample.completion_mask == 1]),
                recomputed_logps(policy, sample),
                terms=TINY_MODEL_TERMS,
            )
    assert metrics["multi_step/steps_per_run"] == (float(sum(TURNS)), float(G))
    assert metrics["unscorable_count"] == 1.0


@pytest.mark.parametrize("enable_step_norm", [False, True])
def test_each_step_carries_its_runs_step_wise_grpo_advantage(tokenizer, enable_step_norm):
    """Scored runs' rewards 1, 0, 2: mean 1, sample std 1, so scores 0, -1, 1 (/ (1 + 1e-6)); each step of a run gets
    its run's score (divided by the run's turns with ``enable_step_norm``); the unscorable run trains nothing. Its
    reward metrics sit on each run's last step only (TRL averages a metric over the samples that carry it)."""
    worker = make_worker(tokenizer, enable_step_norm=enable_step_norm)
    send(worker, build_tiny_model(tokenizer, seed=3), version=1)
    worker._load_committed()
    samples, _ = worker.rollout_group(position=0)
    scores = [0.0, -1.0, None, 1.0]
    for run, turns, score, final in zip(by_run(samples), TURNS, scores, FINAL):
        for s, sample in enumerate(run):
            if score is None:
                assert sample.completion_mask.sum() == 0 and sample.advantage == 0.0
            else:
                expected = score / (1.0 + 1e-6) / (turns if enable_step_norm else 1)
                assert sample.completion_mask.sum() > 0
                assert math.isclose(sample.advantage, expected, rel_tol=1e-6, abs_tol=1e-7)  # float32 of a float64
            last = s == len(run) - 1
            assert ("reward" in sample.metrics) == last
            if last:
                assert sample.metrics["reward"] == (
                    final if final is not None else pytest.approx(float("nan"), nan_ok=True)
                )


def test_a_group_below_the_std_threshold_trains_nothing(tokenizer):
    worker = make_worker(tokenizer, std_threshold=10.0)  # the scored runs' std is 1
    send(worker, build_tiny_model(tokenizer), version=1)
    worker._load_committed()
    samples, metrics = worker.rollout_group(position=0)
    assert all(s.completion_mask.sum() == 0 and s.advantage == 0.0 for s in samples)
    assert metrics["filtered_count"] == float(sum(t for t, f in zip(TURNS, FINAL) if f is not None))


def test_gigpo_adds_the_anchor_state_step_advantage(tokenizer):
    """GiGPO on the same group: the scored runs (returns 1, 0, 2) all act from "start" first, runs 1 and 3 then from
    "turn 1". Episode advantages 0, -1, 1; at "start" the step advantages equal them, at "turn 1" returns 0 and 2 give
    -1 and 1; so run 0: [0], run 1: [-2, -2], run 3: [2, 2], each / (1 + 1e-6)."""
    worker = make_worker(tokenizer, advantage="gigpo")
    send(worker, build_tiny_model(tokenizer, seed=3), version=1)
    worker._load_committed()
    samples, metrics = worker.rollout_group(position=0)
    for run, expected in zip(by_run(samples), [[0.0], [-2.0, -2.0], None, [2.0, 2.0]]):
        if expected is None:  # unscorable: trains nothing
            assert all(s.completion_mask.sum() == 0 and s.advantage == 0.0 for s in run)
            continue
        for sample, value in zip(run, expected, strict=True):
            assert math.isclose(sample.advantage, value / (1 + 1e-6), rel_tol=1e-6, abs_tol=1e-7)
    assert metrics["gigpo/anchor_hit_ratio"] == 1.0 and metrics["gigpo/later_steps"] == 2.0

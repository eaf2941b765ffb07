"""What every rollout returns and what the trainer trains: whole runs (`Run`, one `Step` per model turn) and the
training rows they become (`TrainingRow`).

A `trinity_trl.rollouts.protocols.Rollout` returns one `Run` per task row, whole: every turn the model took, with the
prompt it was sampled after and its sampling log-probs. `Run.training_rows` lays a run out as rows of
`trinity_trl.trainers.StepGRPOTrainer`'s batch: the whole run in one row when every turn's prompt extends the previous
turn's prompt + completion (``shared``), else one row per turn; each trained token carries its turn's index and
advantage.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..algorithms.experience import STATE_KEY, STEP_REWARD

#: the key of a step's `StepResult.info` that names the environment's state after the step (any value with a stable
#: ``repr``; it replaces the observation as the next step's state key). ``info["step_reward"]`` (`STEP_REWARD`)
#: declares the step's immediate reward (GiGPO's r_t).
ENV_STATE_HASH = "env_state_hash"

#: what GiGPO reads of one step (`Run.step_states`): its hashed state key and declared reward (each ``None`` if unknown)
StepState = tuple[str | None, float | None]


def observation_state(observation: str) -> str:
    """The state key of a step that acts after ``observation`` (an environment's text)."""
    return f"observation:{observation}"


def prompt_state(prompt: Any) -> str:
    """The state key of a run's first step when ``reset`` returned no observation: the row's ``prompt`` (a string or
    a conversation)."""
    return f"prompt:{prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, default=str)}"


def tokens_state(kind: str, ids: Sequence[int]) -> str:
    """The state key of token ids (a tool result, an agent's request): ``kind`` says which."""
    return f"{kind}:{','.join(map(str, ids))}"


def declared_state(info: dict[str, Any], observation: str | None) -> str | None:
    """The state key of the step after one whose `StepResult` had ``info`` and ``observation``: the environment's
    ``info["env_state_hash"]`` when it gives one, else the observation (``None`` when there is none)."""
    if ENV_STATE_HASH in info:
        return f"{ENV_STATE_HASH}:{info[ENV_STATE_HASH]!r}"
    return None if observation is None else observation_state(observation)


def declared_step_reward(info: dict[str, Any]) -> float | None:
    """``info["step_reward"]`` as a float (``None`` when absent); ``ValueError`` when it is not a finite number."""
    if STEP_REWARD not in info:
        return None
    value = info[STEP_REWARD]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"info['step_reward']={value!r}: a declared step reward is a finite number")
    return float(value)


@dataclass
class Step:
    """One turn: ``prompt_ids`` (conversation so far), ``completion_ids`` (the model's turn, as sampled),
    ``logprobs`` (their sampling log-probs, when known); ``reward``: what the environment returned with the step (a
    running score for some environments: the run's reward is its last step's); ``policy_version``: the number of
    optimizer steps taken by the weights that sampled it, when the rollout records it (agents do; ``None`` otherwise).

    ``state_key``: the state the turn acted from, for GiGPO's anchor groups (docs/algorithms/advantages.md#gigpo):
    the bundled rollouts record it (docs/trainers/step-grpo.md#gigpo); ``None`` when unknown. ``step_reward``: the
    immediate reward the environment declared for the step (``info["step_reward"]`` of its `StepResult`), ``None``
    when it declared none."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float] | None
    reward: float
    text: str
    policy_version: int | None = None
    state_key: str | None = None
    step_reward: float | None = None


@dataclass
class TrainingRow:
    """One row of the training batch: a chain of steps of one run, as the prompt of its first step and everything
    after it.

    Attributes:
        prompt_ids: the first step's prompt.
        completion_ids: ``(T,)`` the later steps' prompt additions and every step's completion, in order.
        segment_ids: ``(T,)`` the step index a trained token belongs to, -1 elsewhere (observations, untrained steps).
        advantages: ``(T,)`` each trained token's step advantage, 0.0 elsewhere.
        sampling_logps: ``(T,)`` the sampling log-probs of the steps' tokens, NaN where unknown.
        sample_count: steps trained in this row.
        step_width: the longest completion of the row's steps (tokens).
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    segment_ids: list[int]
    advantages: list[float]
    sampling_logps: list[float]
    sample_count: int
    step_width: int

    @classmethod
    def padding(cls, pad_token_id: int) -> TrainingRow:
        """A row that trains nothing (to split the batch evenly into micro-batches)."""
        return cls([pad_token_id], [pad_token_id], [-1], [0.0], [float("nan")], 0, 1)


@dataclass
class Run:
    """One episode. ``reward`` is the reward of the last step (NaN when it could not be scored);
    ``prefix_preserving`` says whether every step's prompt starts with the previous step's prompt +
    completion; ``cut`` whether the run was stopped by the turn limit (``max_env_steps``) before its environment ended
    it; ``malformed`` whether its last turn was a tool call the parser could not read (taken as the final answer).
    ``segments``: the step indices of each chain of steps that extend one another (an agent run over the policy
    endpoint whose history was rewritten has several); ``None`` means one chain when ``prefix_preserving``, else one
    per step."""

    steps: list[Step] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    prefix_preserving: bool = True
    cut: bool = False
    messages: list[dict[str, Any]] = field(default_factory=list)
    segments: list[list[int]] | None = None
    malformed: bool = False

    def step_states(self) -> list[StepState]:
        """Per step, what GiGPO reads (docs/algorithms/advantages.md#gigpo): its ``state_key`` hashed (BLAKE2b, 32 hex
        characters: small enough to gather across processes whatever the key's length; ``None`` when unknown) and its
        declared ``step_reward`` (``None``: none declared)."""
        return [
            (
                None if s.state_key is None else hashlib.blake2b(s.state_key.encode(), digest_size=16).hexdigest(),
                s.step_reward,
            )
            for s in self.steps
        ]

    def chains(self, shared: bool) -> list[list[int]]:
        """The step indices of each training row: each segment (or the whole prefix-preserving run) in one row when
        ``shared``, else one row per step."""
        if self.segments is not None:  # an agent run: its segments (none when it made no call)
            return self.segments if shared else [[s] for segment in self.segments for s in segment]
        if shared and self.prefix_preserving:
            return [list(range(len(self.steps)))]
        return [[s] for s in range(len(self.steps))]

    def trained(self, advantages: Sequence[float | None], eos_token_ids: set[int] | None) -> list[bool]:
        """Per step, whether it is trained: it has an advantage (its group was scored and kept) and, when
        ``eos_token_ids`` is given (``mask_truncated_completions``), its completion ends with one of them."""
        return [
            score is not None
            and (eos_token_ids is None or (bool(step.completion_ids) and step.completion_ids[-1] in eos_token_ids))
            for step, score in zip(self.steps, advantages)
        ]

    def training_rows(
        self, advantages: Sequence[float | None], shared: bool, eos_token_ids: set[int] | None = None
    ) -> list[TrainingRow]:
        """The training rows of this run (see `chains` and `trained`); ``advantages``: per step, its advantage or
        ``None`` (not trained)."""
        trained = self.trained(advantages, eos_token_ids)
        rows = []
        for chain in self.chains(shared):
            first, last = self.steps[chain[0]], self.steps[chain[-1]]
            completion = last.prompt_ids[len(first.prompt_ids) :] + last.completion_ids
            segment, adv, logps = [-1] * len(completion), [0.0] * len(completion), [float("nan")] * len(completion)
            for s in chain:
                step = self.steps[s]
                start = len(step.prompt_ids) - len(first.prompt_ids)
                span = slice(start, start + len(step.completion_ids))
                if step.logprobs:
                    logps[span] = step.logprobs
                if trained[s]:
                    segment[span] = [s] * len(step.completion_ids)
                    adv[span] = [advantages[s]] * len(step.completion_ids)
            rows.append(
                TrainingRow(
                    prompt_ids=first.prompt_ids,
                    completion_ids=completion,
                    segment_ids=segment,
                    advantages=adv,
                    sampling_logps=logps,
                    sample_count=sum(trained[s] for s in chain),
                    step_width=max(len(self.steps[s].completion_ids) for s in chain),
                )
            )
        return rows


def experience_info(state: StepState) -> dict[str, Any]:
    """The ``Experience.info`` of a step whose `Run.step_states` entry is ``state``."""
    key, reward = state
    return {STATE_KEY: key} if reward is None else {STATE_KEY: key, STEP_REWARD: reward}

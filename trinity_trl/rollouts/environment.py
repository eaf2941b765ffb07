"""The environment protocol of multi-step agent training.

An environment is one episode's world. The trainer creates one per run (``environment_factory()``),
calls ``reset`` with the task's dataset row, then alternates: the model writes a turn, ``step``
answers it, until ``done`` or ``max_env_steps`` turns. Every turn becomes one training sample; the
reward of a run is the reward returned with its last step.

A minimal environment::

    class Echo(Environment):
        def reset(self, answer, **row):
            self.answer = answer
            return "Guess the word."

        def step(self, action):
            solved = self.answer in action
            return StepResult("Correct!" if solved else "Try again.", reward=float(solved), done=solved)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class StepResult:
    """What an environment returns after the model's turn.

    Attributes:
        observation: text shown to the model as the next user message (ignored when ``done``).
        reward: reward of this step; the run's reward is the one returned with its last step. ``None``
            means the step cannot be scored (as a TRL reward function's ``None``): a run ending on it gets
            no gradient and is counted in ``unscorable_count``.
        done: whether the episode is over.
        info: anything to keep for logging.
    """

    observation: str | None
    reward: float | None = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class Environment:
    """Base class of reset/step environments (duck typing works too: a class whose public methods are exactly
    ``reset`` and ``step``). An optional ``close()`` is called when the run ends (e.g. to end a server session).
    TRL's tool environments (public methods as tools, optional ``get_reward``) are the other protocol
    `trinity_trl.trainers.StepGRPOTrainer` accepts; see `trinity_trl.rollouts.protocols`."""

    def reset(self, **row: Any) -> str | None:
        """Start an episode for one dataset row (all its columns as keyword arguments).

        Returns the first observation, appended to the row's prompt as user text, or ``None`` to use
        the row's ``prompt`` as it is.
        """
        raise NotImplementedError

    def step(self, action: str) -> StepResult:
        """React to the model's turn ``action`` (decoded text)."""
        raise NotImplementedError


class EnvironmentFailure(RuntimeError):
    """An environment failed during a rollout; the message names the run, its dataset row and the turn."""

"""Guess a hidden number with higher/lower feedback: binary search takes several turns."""

from __future__ import annotations

import random
import re

from ..environment import Environment, StepResult

_NUMBER = re.compile(r"-?\d+")


class NumberGuessEnv(Environment):
    """The model guesses an integer in ``[low, high]``; each wrong guess is answered "higher" or "lower".

    Reward: 1.0 when the last guess is right, else 0.0 (``partial_credit=True`` adds
    ``0.5 · (1 − distance / range)`` for the closest miss, a denser signal for small models). A turn
    without a number is answered with a reminder and counts as a step.

    Each step's ``info["env_state_hash"]`` is the game's state after it: the range the hints so far leave,
    ``(lowest, highest)`` (a guess outside it, or a turn without a number, leaves it as it was), so GiGPO groups the
    turns of different runs that know the same (docs/trainers/step-grpo.md#gigpo). The reward is the running
    score, not an immediate reward: no ``info["step_reward"]`` is declared.
    """

    def __init__(self, partial_credit: bool = False):
        self.partial_credit = partial_credit

    def reset(self, target: int, low: int = 1, high: int = 100, **row) -> str:
        if not low <= target <= high:
            raise ValueError(f"target {target} is outside [{low}, {high}]")
        self.target, self.low, self.high = int(target), int(low), int(high)
        self.best_distance = high - low
        self.known = (self.low, self.high)  # the range the hints so far leave
        return (
            f"I am thinking of a whole number between {low} and {high}. Guess it. "
            "Answer with one number; I will say higher or lower."
        )

    def step(self, action: str) -> StepResult:
        found = _NUMBER.findall(action)
        if not found:
            return StepResult(
                "Please answer with a single whole number.",
                reward=self._miss_reward(),
                info={"env_state_hash": self.known},
            )
        guess = int(found[-1])
        if guess == self.target:
            return StepResult("Correct!", reward=1.0, done=True, info={"guess": guess})
        self.best_distance = min(self.best_distance, abs(guess - self.target))
        lowest, highest = self.known
        if guess < self.target:
            hint, self.known = "higher", (max(lowest, guess + 1), highest)
        else:
            hint, self.known = "lower", (lowest, min(highest, guess - 1))
        return StepResult(
            f"{guess} is wrong. The number is {hint}.",
            reward=self._miss_reward(),
            info={"guess": guess, "env_state_hash": self.known},
        )

    def _miss_reward(self) -> float:
        if not self.partial_credit:
            return 0.0
        return 0.5 * (1.0 - self.best_distance / max(1, self.high - self.low))


def number_guess_dataset(n: int = 64, low: int = 1, high: int = 100, seed: int = 0):
    """A ``datasets.Dataset`` of ``n`` games (columns ``target``, ``low``, ``high``)."""
    from datasets import Dataset

    rng = random.Random(seed)
    return Dataset.from_dict(
        {
            "target": [rng.randint(low, high) for _ in range(n)],
            "low": [low] * n,
            "high": [high] * n,
        }
    )

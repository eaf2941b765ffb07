"""The reset/step rollout: failures name the run, its row and the turn; None rewards; routing; close (no model)."""

from __future__ import annotations

import math

import pytest

from trinity_trl.rollouts import Environment, EnvironmentFailure, MultiStepRollout, StepResult


class CharGenerator:
    """A scripted Generator: characters are token ids, 0 ends a message; every turn is ``"go"``."""

    eos_token_id = 0
    eos_token_ids = {0}

    def render(self, messages, add_generation_prompt):
        ids = [t for m in messages for t in [*map(ord, f"{m['role']}:{m['content']}"), 0]]
        return ids + (list(map(ord, "assistant:")) if add_generation_prompt else [])

    def tokenize_conversations(self, conversations):
        return [self.render(c, True) for c in conversations]

    def generate(self, prompt_ids):
        return [[ord("g"), ord("o"), 0] for _ in prompt_ids], None

    def decode(self, ids):
        return "".join(chr(t) for t in ids if t)


class Scripted(Environment):
    closed = []

    def reset(self, fail_at=-1, reward=1.0, length=2, **row):
        self.fail_at, self.reward, self.length, self.turn = int(fail_at), reward, int(length), 0
        return "start"

    def step(self, action):
        self.turn += 1
        if self.turn - 1 == self.fail_at:
            raise KeyError("boom")
        done = self.turn >= self.length
        return StepResult(None if done else "more", reward=self.reward if done else 0.0, done=done)

    def close(self):
        Scripted.closed.append(self)


def play(rows, factory=Scripted, max_steps=5):
    return MultiStepRollout(CharGenerator(), factory, max_steps)(rows)


def test_a_step_that_raises_names_the_run_its_row_and_the_turn():
    with pytest.raises(
        EnvironmentFailure, match=r"run 1 \(fail_at=1\), turn 1: Scripted.step\(\) failed: KeyError: 'boom'"
    ):
        play([{"fail_at": -1}, {"fail_at": 1}])


def test_a_reset_that_raises_and_a_step_without_an_observation():
    class BadReset(Scripted):
        def reset(self, **row):
            raise ValueError("no such task")

    class Silent(Scripted):
        def step(self, action):
            return StepResult(None)

    class Text(Scripted):
        def step(self, action):
            return "fine"

    with pytest.raises(
        EnvironmentFailure, match=r"run 0 \(task=3\): BadReset.reset\(\) failed: ValueError: no such task"
    ):
        play([{"task": 3}], BadReset)
    with pytest.raises(EnvironmentFailure, match=r"run 0 \(\), turn 0: Silent.step\(\) returned no observation"):
        play([{}], Silent)
    with pytest.raises(EnvironmentFailure, match=r"turn 0: Text.step\(\) must return a StepResult, got str"):
        play([{}], Text)


def test_a_none_reward_makes_the_run_unscorable_and_turn_limits_cut_runs():
    runs = play([{"reward": None}, {"length": 9}], max_steps=3)
    assert math.isnan(runs[0].reward) and not runs[0].cut and len(runs[0].steps) == 2
    assert runs[1].cut and len(runs[1].steps) == 3 and runs[1].done


def test_environments_are_closed_when_their_run_ends_even_on_failure():
    Scripted.closed = []
    play([{"length": 1}, {"length": 4}], max_steps=2)
    assert len(Scripted.closed) == 2
    Scripted.closed = []
    with pytest.raises(EnvironmentFailure):
        play([{"length": 1}, {"fail_at": 1, "length": 4}, {"length": 5}])
    assert len(Scripted.closed) == 3


def test_a_dict_of_factories_routes_rows_by_their_environment_column():
    class Long(Scripted):
        def reset(self, **row):
            assert "environment" not in row  # a control column, not a task column (as in TRL)
            return super().reset(length=3, **row)

    runs = play([{"environment": "short"}, {"environment": "long"}], {"short": Scripted, "long": Long})
    assert [len(r.steps) for r in runs] == [2, 3]
    with pytest.raises(EnvironmentFailure, match=r"environment='other' is not among .*\['short', 'long'\]"):
        play([{"environment": "other"}], {"short": Scripted, "long": Long})

"""Which protocol an environment follows, and the one-line errors for classes that fit neither (no model)."""

from __future__ import annotations

import pytest

from trinity_trl.rollouts import (
    STEP_PROTOCOL,
    TOOL_PROTOCOL,
    CalculatorEnv,
    CalculatorToolEnv,
    Environment,
    NumberGuessEnv,
    StepResult,
    resolve_protocol,
)


class DuckStep:  # reset/step by duck typing
    def reset(self, **row):
        return "go"

    def step(self, action):
        return StepResult(None, 1.0, True)


class ToolWithAStepTool:  # `step` next to other public methods is a tool
    def reset(self, **row):
        return None

    def step(self, direction: str) -> str:
        """Move.

        Args:
            direction: Where to.
        """
        return direction

    def look(self) -> str:
        """Look around."""
        return "a wall"


class OnlyReset:  # TRL accepts it: a single-turn environment with no tools
    def reset(self, **row):
        return None

    def get_reward(self):
        return 1.0


@pytest.mark.parametrize(
    "factory, protocol",
    [
        (CalculatorEnv, STEP_PROTOCOL),
        (lambda: NumberGuessEnv(partial_credit=True), STEP_PROTOCOL),
        (DuckStep, STEP_PROTOCOL),
        (CalculatorToolEnv, TOOL_PROTOCOL),
        (ToolWithAStepTool, TOOL_PROTOCOL),
        (OnlyReset, TOOL_PROTOCOL),
    ],
)
def test_the_protocol_is_read_from_the_class(factory, protocol):
    assert resolve_protocol(factory)[0] == protocol


def test_a_dict_of_factories_and_standalone_tools():
    protocol, classes = resolve_protocol({"calc": CalculatorToolEnv, "other": ToolWithAStepTool})
    assert protocol == TOOL_PROTOCOL and classes == {"calc": CalculatorToolEnv, "other": ToolWithAStepTool}
    assert resolve_protocol(None, [len]) == (TOOL_PROTOCOL, {})


class NoReset:
    def step(self, action):
        return StepResult("x")


class Nothing:
    def act(self, x):
        return x


class HalfEnvironment(Environment):
    def reset(self, **row):
        return "hi"


class NarrowReset:
    def reset(self, question):
        return question

    def calc(self, expression: str) -> str:
        """Compute.

        Args:
            expression: The expression.
        """
        return expression


class NeedsSeed(Environment):
    def reset(self, seed, **row):
        return "hi"

    def step(self, action):
        return StepResult(None, done=True)


class Closes:
    closed = 0

    def reset(self, **row):
        return None

    def step(self, action):
        return StepResult(None, done=True)

    def close(self):
        Closes.closed += 1


@pytest.mark.parametrize(
    "factory, tools, columns, error, match",
    [
        (NoReset, None, None, TypeError, r"NoReset defines no reset\(\*\*row\).*it defines step\(\): add reset"),
        (Nothing, None, None, TypeError, r"Nothing defines no reset.*its public methods: act"),
        (HalfEnvironment, None, None, TypeError, r"HalfEnvironment subclasses .*Environment but does not define step"),
        (
            CalculatorEnv(),
            None,
            None,
            TypeError,
            r"environment_factory must be a callable .*got CalculatorEnv instance",
        ),
        (
            lambda: CalculatorEnv,
            None,
            None,
            TypeError,
            r"must return an environment instance, got the class CalculatorEnv",
        ),
        (
            lambda: 1 / 0,
            None,
            None,
            TypeError,
            r"environment_factory\(\) failed while the trainer probed it: ZeroDivisionError",
        ),
        ({"a": CalculatorEnv, "b": CalculatorToolEnv}, None, None, ValueError, r"one protocol, got 'a': CalculatorEnv"),
        ({"a": CalculatorEnv, "b": NoReset}, None, None, TypeError, r"NoReset defines no reset"),
        ({}, None, None, ValueError, r"empty dict"),
        (None, None, None, ValueError, r"needs environment_factory .*, tools, or agent= "),
        (
            CalculatorEnv,
            [len],
            None,
            ValueError,
            r"tools= needs TRL's tool protocol, but CalculatorEnv is a reset/step",
        ),
        (CalculatorToolEnv, ["calc"], None, TypeError, r"tools must be callables"),
        (
            NarrowReset,
            None,
            ["prompt", "question", "answer"],
            TypeError,
            r"NarrowReset.reset\(\) .* does not accept \['prompt', 'answer'\]",
        ),
        (
            NeedsSeed,
            None,
            ["prompt", "target"],
            TypeError,
            r"NeedsSeed.reset\(\) requires \['seed'\], which the dataset",
        ),
    ],
)
def test_every_wrong_environment_fails_at_construction_in_one_line(factory, tools, columns, error, match):
    with pytest.raises(error, match=match) as info:
        resolve_protocol(factory, tools, columns)
    assert "\n" not in str(info.value)


def test_columns_a_protocol_does_not_pass_to_reset_are_not_required():
    # reset/step: every column but `prompt`; TRL's tools: every column, `environment` excepted when routed
    resolve_protocol(CalculatorEnv, None, ["prompt", "question", "answer"])
    resolve_protocol({"calc": CalculatorToolEnv}, None, ["prompt", "environment", "answer"])


def test_the_probe_instance_is_closed():
    Closes.closed = 0
    resolve_protocol(lambda: Closes())
    assert Closes.closed == 1

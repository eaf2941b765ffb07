"""Bundled environments that need several steps to solve."""

from ..environment_registry import ENVIRONMENTS, NamedEnvironment
from .calculator import CalculatorEnv, CalculatorToolEnv, calculator_dataset, calculator_tool_dataset
from .calculator_agent import calculator_agent
from .number_guess import NumberGuessEnv, number_guess_dataset


def _multiplication_problems(n: int, seed: int = 0):
    from ...data import arithmetic_dataset

    return arithmetic_dataset("train", n, seed=seed, kinds=["mul"])


# the names the step_grpo recipe takes (``environment: NAME``); partial credit: the bundled model rarely solves a task
ENVIRONMENTS.register("number_guess")(
    NamedEnvironment(lambda: NumberGuessEnv(partial_credit=True), number_guess_dataset)
)
ENVIRONMENTS.register("calculator")(NamedEnvironment(lambda: CalculatorEnv(partial_credit=True), calculator_dataset))
ENVIRONMENTS.register("calculator_tools")(NamedEnvironment(CalculatorToolEnv, calculator_tool_dataset))  # TRL tools
ENVIRONMENTS.register("calculator_agent")(NamedEnvironment(calculator_agent, _multiplication_problems, agent=True))

__all__ = [
    "CalculatorEnv",
    "CalculatorToolEnv",
    "NumberGuessEnv",
    "calculator_agent",
    "calculator_dataset",
    "calculator_tool_dataset",
    "number_guess_dataset",
]

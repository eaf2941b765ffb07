"""Bundled environments that need several steps to solve."""

from .calculator import CalculatorEnv, CalculatorToolEnv, calculator_dataset, calculator_tool_dataset
from .calculator_agent import calculator_agent
from .number_guess import NumberGuessEnv, number_guess_dataset

__all__ = [
    "CalculatorEnv",
    "CalculatorToolEnv",
    "NumberGuessEnv",
    "calculator_agent",
    "calculator_dataset",
    "calculator_tool_dataset",
    "number_guess_dataset",
]

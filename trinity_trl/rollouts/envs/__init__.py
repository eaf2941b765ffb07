"""Bundled environments that need several steps to solve."""

from .calculator import CalculatorEnv, calculator_dataset
from .number_guess import NumberGuessEnv, number_guess_dataset

__all__ = ["CalculatorEnv", "NumberGuessEnv", "calculator_dataset", "number_guess_dataset"]

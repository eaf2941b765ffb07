"""Multi-step environments and the rollout that turns episodes into one sample per turn."""

from .environment import Environment, StepResult
from .envs import CalculatorEnv, NumberGuessEnv, calculator_dataset, number_guess_dataset
from .generation import Generator
from .multi_step import MultiStepRollout, Run, Step

__all__ = [
    "CalculatorEnv",
    "Environment",
    "Generator",
    "MultiStepRollout",
    "NumberGuessEnv",
    "Run",
    "Step",
    "StepResult",
    "calculator_dataset",
    "number_guess_dataset",
]

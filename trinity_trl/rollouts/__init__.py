"""Multi-step environments and the rollout that turns episodes into one sample per turn."""

from .environment import Environment, EnvironmentFailure, StepResult
from .envs import (
    CalculatorEnv,
    CalculatorToolEnv,
    NumberGuessEnv,
    calculator_dataset,
    calculator_tool_dataset,
    number_guess_dataset,
)
from .generation import Generator
from .multi_step import MultiStepRollout, Run, Step
from .protocols import STEP_PROTOCOL, TOOL_PROTOCOL, resolve_protocol
from .trajectories import run_from_trajectory
from .protocols import STEP_PROTOCOL, TOOL_PROTOCOL, resolve_protocol
from .trajectories import run_from_trajectory

__all__ = [
    "CalculatorEnv",
    "CalculatorToolEnv",
    "Environment",
    "EnvironmentFailure",
    "Generator",
    "MultiStepRollout",
    "NumberGuessEnv",
    "Run",
    "STEP_PROTOCOL",
    "Step",
    "StepResult",
    "TOOL_PROTOCOL",
    "calculator_dataset",
    "calculator_tool_dataset",
    "number_guess_dataset",
    "resolve_protocol",
    "run_from_trajectory",
]

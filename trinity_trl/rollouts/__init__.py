"""Multi-step environments and the rollouts that turn episodes into one sample per turn.

Two environment protocols (`protocols`): this package's reset/step `Environment`, played by
`MultiStepRollout`, and TRL's tool environments, played by TRL's own tool loop and split into turns by
`run_from_trajectory`. OpenEnv environments: `openenv` (the ``openenv`` extra). Agents that call an
OpenAI client: `AgentRollout` over the trainer's `PolicyEndpoint` (the ``agents`` extra).
"""

from .agent import AgentRollout
from .endpoint import ChatRenderer, PolicyEndpoint
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

__all__ = [
    "AgentRollout",
    "ChatRenderer",
    "PolicyEndpoint",
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

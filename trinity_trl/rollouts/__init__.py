"""Multi-step environments and the rollouts that turn episodes into one sample per turn.

Every way of playing runs is a `Rollout` (`protocols`) returning whole `Run`s, which the trainer lays out as
`TrainingRow`s (`runs`): `MultiStepRollout` plays this package's reset/step `Environment`s, `ToolRollout` reads TRL's
tool environments back from TRL's own tool loop (`run_from_trajectory`), `AgentRollout` plays agents that call an
OpenAI client over the trainer's `PolicyEndpoint` (the ``agents`` extra). OpenEnv environments: `openenv` (the
``openenv`` extra).
"""

from .agent import AgentRollout
from .endpoint import ChatRenderer, PolicyEndpoint
from .environment import Environment, EnvironmentFailure, StepResult
from .environment_registry import ENVIRONMENTS, NamedEnvironment, register_environment
from .envs import (
    CalculatorEnv,
    CalculatorToolEnv,
    NumberGuessEnv,
    calculator_dataset,
    calculator_tool_dataset,
    number_guess_dataset,
)
from .generation import Generator
from .multi_step import MultiStepRollout
from .protocols import (
    STEP_PROTOCOL,
    TOOL_PROTOCOL,
    PlayedRollout,
    Rollout,
    RolloutContext,
    environment_reward,
    resolve_protocol,
)
from .runs import Run, Step, TrainingRow
from .trajectories import ToolRollout, run_from_trajectory

__all__ = [
    "AgentRollout",
    "ChatRenderer",
    "PolicyEndpoint",
    "CalculatorEnv",
    "CalculatorToolEnv",
    "ENVIRONMENTS",
    "Environment",
    "EnvironmentFailure",
    "Generator",
    "MultiStepRollout",
    "NamedEnvironment",
    "NumberGuessEnv",
    "PlayedRollout",
    "Rollout",
    "RolloutContext",
    "Run",
    "STEP_PROTOCOL",
    "Step",
    "StepResult",
    "TOOL_PROTOCOL",
    "ToolRollout",
    "TrainingRow",
    "calculator_dataset",
    "calculator_tool_dataset",
    "environment_reward",
    "number_guess_dataset",
    "register_environment",
    "resolve_protocol",
    "run_from_trajectory",
]

"""Which `Rollout` plays an environment: the reset/step protocol's or TRL's tool protocol's (see
`trinity_trl.rollouts.protocols` for how the protocol is read from the environment's class)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from .multi_step import MultiStepRollout
from .protocols import STEP_PROTOCOL, TOOL_PROTOCOL, Rollout, resolve_protocol
from .trajectories import ToolRollout


def environment_rollout(
    environment_factory: Callable | dict[str, Callable] | None,
    tools: Iterable | None,
    columns: Iterable[str] | None,
    max_env_steps: int,
    history: str = "tokens",
) -> Rollout:
    """The rollout of ``environment_factory`` and ``tools`` (checked by `resolve_protocol`): a
    `trinity_trl.rollouts.MultiStepRollout` for reset/step environments, a `trinity_trl.rollouts.ToolRollout` for TRL's
    tool environments and standalone tools."""
    protocol, classes = resolve_protocol(environment_factory, tools, columns)
    names = sorted({cls.__qualname__ for cls in classes.values()})
    kind = {STEP_PROTOCOL: MultiStepRollout, TOOL_PROTOCOL: ToolRollout}[protocol]
    return kind.for_environments(environment_factory, tools, max_env_steps, history, names)

"""Environments by name: what ``environment: NAME`` (YAML) or ``--environment NAME`` picks in the ``step_grpo`` recipe.

The bundled environments register themselves here (`trinity_trl.rollouts.envs`). An environment of one's own
registers from a file or module named with ``import:`` (YAML, relative to the YAML file) or ``--import``, exactly as a
loss or an advantage estimator does (docs/environments.md#your-own-environment-from-a-file)::

    from trinity_trl.rollouts import Environment, StepResult, register_environment

    @register_environment("countdown", dataset=countdown_tasks)  # countdown_tasks(num_tasks, seed=...) -> Dataset
    class Countdown(Environment):
        ...

The registered object is what ``StepGRPOTrainer`` takes: an ``environment_factory`` (a reset/step environment or a
TRL tool environment), or with ``agent=True`` an ``async def agent(client, row)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..algorithms.registry import Registry


@dataclass
class NamedEnvironment:
    """One registered environment.

    Attributes:
        factory: the ``environment_factory`` (a class or a function building one environment per run), or the agent
            function when ``agent``.
        dataset: ``dataset(num_tasks, seed=...)`` building the tasks (each row's columns go to ``reset`` or to the
            agent), or ``None``: the environment owns the data (``reset`` draws each task; set ``max_steps``).
        agent: ``factory`` is an agent (``StepGRPOTrainer(agent=...)``), not an environment.
        name: the name it was registered under.
    """

    factory: Callable[..., Any]
    dataset: Callable[..., Any] | None = None
    agent: bool = False
    name: str = ""

    def trainer_arguments(self, num_tasks: int, seed: int) -> dict[str, Any]:
        """``StepGRPOTrainer`` keyword arguments: ``train_dataset`` and ``environment_factory`` or ``agent``."""
        tasks = None if self.dataset is None else self.dataset(num_tasks, seed=seed)
        played = {"agent": self.factory} if self.agent else {"environment_factory": self.factory}
        return {"train_dataset": tasks, **played}


#: name -> `NamedEnvironment`
ENVIRONMENTS: Registry[NamedEnvironment] = Registry("environment")


def register_environment(
    name: str, dataset: Callable[..., Any] | None = None, agent: bool = False
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator registering an environment factory (or, with ``agent=True``, an agent function) under ``name``, with
    the function building its tasks (``dataset(num_tasks, seed=...)``; ``None``: the environment owns the data).
    Returns the factory unchanged; a name already taken is a ``ValueError``."""
    if dataset is not None and not callable(dataset):
        raise TypeError(f"register_environment({name!r}): dataset must be a function (num_tasks, seed=...) -> Dataset")

    def decorator(factory: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(factory):
            raise TypeError(f"register_environment({name!r}) decorates a class or a function, got {factory!r:.80}")
        ENVIRONMENTS.register(name)(NamedEnvironment(factory, dataset, agent))
        return factory

    return decorator

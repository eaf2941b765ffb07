"""OpenEnv environments (``openenv-core``) trained step by step: each model turn is one OpenEnv action.

`OpenEnv <https://github.com/meta-pytorch/OpenEnv>`_ runs an environment as a server (HTTP/WebSocket, one
session per client) and ships typed clients (``EnvClient`` subclasses, or ``GenericEnvClient`` with plain
dicts); an ``openenv.core.Environment`` can also be used in-process. `OpenEnvEnvironment` wraps either
in the reset/step protocol, so `trinity_trl.trainers.StepGRPOTrainer` plays it: the model's text
becomes the environment's action (``action``), the observation it returns becomes the next user message
(``observation``), and the run's reward is the reward OpenEnv returned with the last step. One client (one
server session) per run, closed when the run ends::

    from openenv.core import GenericEnvClient
    from trinity_trl.rollouts.openenv import OpenEnvEnvironment

    def make_env():
        client = GenericEnvClient(base_url="http://127.0.0.1:8000").sync()
        return OpenEnvEnvironment(client, action=lambda text: {"message": text})

    trainer = StepGRPOTrainer(model=..., args=StepGRPOConfig(...), train_dataset=tasks, environment_factory=make_env)

Install with ``pip install "trinity-trl[openenv]"`` (pins ``openenv-core``). This module imports nothing from
OpenEnv itself: it only calls the client's (or environment's) ``reset``, ``step`` and ``close``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from .environment import Environment, StepResult

#: fields every OpenEnv observation has; the rest is what the model reads
OBSERVATION_CONTROL_FIELDS = ("done", "reward", "metadata")


def observation_text(observation: Any) -> str:
    """Default text of an OpenEnv observation: its one content field as text, or its content fields as JSON.

    Works for typed observations (pydantic models) and ``GenericEnvClient``'s dicts; ``done``, ``reward`` and
    ``metadata`` are left out.
    """
    if isinstance(observation, str):
        return observation
    fields = observation.model_dump() if hasattr(observation, "model_dump") else dict(observation)
    content = {k: v for k, v in fields.items() if k not in OBSERVATION_CONTROL_FIELDS}
    if len(content) == 1:
        value = next(iter(content.values()))
        return value if isinstance(value, str) else json.dumps(value, default=str)
    return json.dumps(content, default=str)


def _unpack(result: Any) -> tuple[Any, float | None, bool]:
    """``(observation, reward, done)`` of a client's ``StepResult`` or of an in-process environment's observation."""
    if hasattr(result, "observation") and hasattr(result, "done") and not hasattr(result, "model_dump"):
        return result.observation, result.reward, bool(result.done)
    if isinstance(result, dict):  # an observation as a dict
        return result, result.get("reward"), bool(result.get("done", False))
    return result, getattr(result, "reward", None), bool(getattr(result, "done", False))


class OpenEnvEnvironment(Environment):
    """An OpenEnv client (or in-process ``openenv.core.Environment``) as a reset/step environment.

    Args:
        env: a synchronous OpenEnv client (``SomeEnvClient(base_url=...).sync()``, ``GenericEnvClient(...).sync()``)
            or an in-process OpenEnv environment: anything with ``reset(**kwargs)`` and ``step(action)`` returning an
            OpenEnv ``StepResult`` or observation.
        action: the model's turn (text) -> the action to send (an ``Action`` instance, or a dict for
            ``GenericEnvClient``).
        observation: an observation -> the text the model reads next (default `observation_text`).
        reset_columns: the dataset columns passed to OpenEnv's ``reset`` (default: all of them; an OpenEnv server
            drops the ones its environment's ``reset`` does not take).
        instructions: text put before the first observation (e.g. how to write an action), or ``None``.

    A step reward of ``None`` (OpenEnv's "no reward") is kept as ``None``: a run ending on it is unscorable and
    counted, never silently rewarded 0.
    """

    def __init__(
        self,
        env: Any,
        action: Callable[[str], Any],
        observation: Callable[[Any], str] = observation_text,
        reset_columns: Sequence[str] | None = None,
        instructions: str | None = None,
    ):
        for method in ("reset", "step"):
            if not callable(getattr(env, method, None)):
                raise TypeError(
                    f"OpenEnvEnvironment needs an OpenEnv client or environment with reset() and step(), "
                    f"got {type(env).__name__} without {method}()"
                    + (" (an async EnvClient: pass client.sync())" if method == "reset" else "")
                )
        self.env, self.action, self.observation = env, action, observation
        self.reset_columns = None if reset_columns is None else list(reset_columns)
        self.instructions = instructions

    def reset(self, **row: Any) -> str | None:
        kwargs = row if self.reset_columns is None else {k: row[k] for k in self.reset_columns if k in row}
        observation, _, _ = _unpack(self.env.reset(**kwargs))
        text = self.observation(observation)
        return "\n\n".join(t for t in (self.instructions, text) if t) or None

    def step(self, action: str) -> StepResult:
        observation, reward, done = _unpack(self.env.step(self.action(action)))
        return StepResult(self.observation(observation), reward=None if reward is None else float(reward), done=done)

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            close()

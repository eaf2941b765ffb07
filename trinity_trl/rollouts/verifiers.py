"""verifiers environments as ``StepGRPOTrainer`` agents (the ``verifiers`` extra).

A verifiers environment (``vf.MultiTurnEnv``, ``vf.ToolEnv``, ``vf.SingleTurnEnv``, ... with a ``vf.Rubric``) plays a
whole rollout itself through an OpenAI-style client. `VerifiersAgent` hands it the client of the agent door
(`trinity_trl.rollouts.agent`), wrapped in verifiers' own chat-completions client, so every model call of the
rollout goes to the policy endpoint and is recorded exactly as sampled; the rubric's weighted reward is the run's
reward and its metrics are the run's info.

Which verifiers: the classic environment API (``load_environment`` returning a ``vf.Environment``), which verifiers
0.3.x ships (0.3.0 at ``verifiers.*``, 0.3.1 under ``verifiers.legacy`` with the old names kept). verifiers 0.4 removed
it: it ships only its v1 stack (taskset + harness), whose harnesses run as scripts that fetch ``uv`` and their
dependencies from the network before each rollout, so it cannot train offline. The extra pins ``verifiers>=0.3.1,<0.4``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

#: the model name sent with each request (the endpoint answers any name with the policy)
MODEL_NAME = "policy"


def _vf():
    """The classic verifiers API, or an ImportError that says how to get it."""
    try:
        import verifiers
        from verifiers.legacy import Environment
        from verifiers.legacy.clients import OpenAIChatCompletionsClient
    except ImportError as err:  # not installed, or verifiers >= 0.4 (no classic API)
        raise ImportError(
            "VerifiersAgent needs verifiers' classic environment API (verifiers>=0.3.1,<0.4): "
            'pip install "trinity-trl[verifiers]"'
            + (f" (found verifiers {verifiers.__version__})" if "verifiers" in locals() else "")
        ) from err
    return Environment, OpenAIChatCompletionsClient


class VerifiersAgent:
    """Train a verifiers environment with ``StepGRPOTrainer(agent=VerifiersAgent(env), train_dataset=...)``.

    Args:
        env: a verifiers ``Environment`` (built by hand or by ``verifiers.load_environment(name)``).
        sampling_args: extra request arguments (``max_tokens``, ``stop``, ...) sent with every model call, on top of
            the environment's own; ``temperature`` and ``top_p`` are the trainer's and may only repeat them.

    Each dataset row is one rollout input (``prompt``, and ``answer``, ``info``, ``example_id`` where the environment
    uses them): `dataset` returns the environment's own dataset in that form. A rubric with group reward
    functions (scored over all rollouts of a prompt together) is refused: the agent door scores each run alone.
    A rollout that verifiers ends with an error (a refused request, a tool failure it does not catch) keeps the
    rubric's reward, which is how verifiers scores it; the error is the run's info.
    """

    def __init__(self, env: Any, sampling_args: dict[str, Any] | None = None):
        environment, self._client_class = _vf()
        if not isinstance(env, environment):
            raise TypeError(f"VerifiersAgent needs a verifiers Environment, got {type(env).__name__}")
        if env.requires_group_rollouts:
            raise ValueError(
                "VerifiersAgent scores each rollout alone: this environment's rubric has group reward functions "
                f"({', '.join(_names(env.rubric))}), which need all rollouts of a prompt at once"
            )
        self.env = env
        # the environment's defaults (n=1, extra_body), then the caller's; None values are dropped by verifiers
        self.sampling_args = {**(env.sampling_args or {}), **(sampling_args or {})}
        if self.sampling_args.get("n", 1) != 1:
            raise ValueError("VerifiersAgent samples one answer per call (n=1): the group is num_generations runs")
        self.__name__ = self.__qualname__ = f"VerifiersAgent({type(env).__name__})"

    def dataset(self, n: int = -1, seed: int | None = None):
        """The environment's training dataset, one row per rollout input (``env.get_dataset``)."""
        return self.env.get_dataset(n=n, seed=seed)

    async def __call__(self, client: Any, row: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        """One rollout of ``row`` with the policy behind ``client``: ``(the rubric's reward, info)``."""
        output = await self.env.run_rollout(
            dict(row), self._client_class(client), MODEL_NAME, dict(self.sampling_args), max_retries=0
        )
        reward = output.get("reward")
        info = {"metrics": dict(output.get("metrics") or {}), "stop_condition": output.get("stop_condition")}
        if output.get("error"):
            info["error"] = output["error"]
        return (math.nan if reward is None else float(reward)), info


def _names(rubric: Any) -> Iterable[str]:
    return [getattr(f, "__name__", repr(f)) for f in getattr(rubric, "funcs", [])]

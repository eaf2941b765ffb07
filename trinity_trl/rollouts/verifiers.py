"""verifiers environments as ``StepGRPOTrainer`` agents (the ``verifiers`` extra).

A verifiers environment plays a whole rollout itself through an OpenAI-style client. `VerifiersAgent` hands it the
client of the agent door (`trinity_trl.rollouts.agent`), so every model call of the rollout goes to the policy
endpoint and is recorded exactly as sampled; the environment's own scoring gives the run's reward. It takes the two
environment APIs verifiers has shipped, told apart by what the environment object is:

- the classic API (``vf.Environment``: ``SingleTurnEnv``, ``MultiTurnEnv``, ``ToolEnv``, ... with a ``vf.Rubric``;
  verifiers 0.3.0 at ``verifiers.*``, 0.3.1 under ``verifiers.legacy`` with the old names kept): the environment's
  ``run_rollout`` is given the door's client wrapped in verifiers' own chat-completions client; the rubric's weighted
  reward is the run's reward.
- the v1 API (``verifiers.v1.Env``, e.g. ``vf.SingleAgentEnv`` over a ``vf.Taskset``; verifiers 0.4 ships only this):
  verifiers' own episode runs (``Env.run_episode``: task setup, the harness program, the task's ``@vf.reward``
  scoring), its harness reaching the model through verifiers' interception server, which forwards each request as
  the harness wrote it (chat completions, Responses or Messages, streamed or not) to the policy endpoint, at the
  run's own base URL (its key in the path: verifiers sends one key for every rollout). The trace's weighted reward is
  the run's reward.

A v1 rollout trains only where it runs offline: the agent seat on the ``subprocess`` runtime (every other runtime is
a remote sandbox service or a container installed from the network); a harness that needs no container; for
verifiers' own ``null`` and ``bash`` harnesses, whose program verifiers prepares with ``uv sync --script``, ``uv``
on the program's ``PATH`` and local package sources (``UV_DEFAULT_INDEX`` and ``UV_FIND_LINKS`` in the harness's
``env``): the program is then prepared once, offline, when the agent is built. Anything else is refused when the
agent is built, in one line naming why (docs/environments.md#verifiers).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import math
import os
import shutil
from collections.abc import Iterable
from typing import Any

from .agent import PolicyAccess

#: the model name sent with each request (the endpoint answers any name with the policy)
MODEL_NAME = "policy"

#: why each v1 runtime other than ``subprocess`` cannot run offline
_NETWORK_RUNTIMES = {
    "prime": "Prime's remote sandboxes",
    "modal": "Modal's remote sandboxes",
    "e2b": "E2B's remote sandboxes",
    "docker": "a container whose image and harness install come from the network",
    "podman": "a container whose image and harness install come from the network",
    "apptainer": "a container whose image and harness install come from the network",
}
#: the uv settings that name package sources (each must be local for the harness program to be prepared offline)
_UV_SOURCES = ("UV_DEFAULT_INDEX", "UV_INDEX_URL", "UV_INDEX", "UV_EXTRA_INDEX_URL", "UV_FIND_LINKS")
#: the API key variable of verifiers' client config: unset, since the run's key is in its base URL
_UNSET_KEY_VAR = "TRINITY_TRL_VERIFIERS_UNSET_API_KEY"


def _api() -> tuple[Any, Any, Any]:
    """``(classic Environment class, its chat-completions client class, v1 Env class)``, None where absent; an
    ImportError that says how to get verifiers when it has neither API."""
    classic = classic_client = v1_env = None
    try:
        from verifiers.legacy import Environment as classic
        from verifiers.legacy.clients import OpenAIChatCompletionsClient as classic_client
    except ImportError:
        try:  # verifiers 0.3.0: the classic API at the package root
            from verifiers import Environment as classic
            from verifiers.clients import OpenAIChatCompletionsClient as classic_client
        except ImportError:
            classic = classic_client = None
    try:
        import verifiers.v1 as vf1
        from verifiers.v1.configs.agent import agent_config_fields  # noqa: F401 - verifiers 0.4's v1 (0.3.1's lacks it)

        v1_env = vf1.Env
    except ImportError:
        pass
    if classic is None and v1_env is None:
        try:
            import verifiers

            found = f" (found verifiers {verifiers.__version__})"
        except ImportError:
            found = ""
        raise ImportError(
            "VerifiersAgent needs verifiers' classic environment API (verifiers>=0.3.1,<0.4) or its v1 Env "
            f'(verifiers 0.4): pip install "trinity-trl[verifiers]"{found}'
        )
    return classic, classic_client, v1_env


class VerifiersAgent:
    """Train a verifiers environment with ``StepGRPOTrainer(agent=VerifiersAgent(env), train_dataset=...)``.

    Args:
        env: a classic verifiers ``Environment`` (verifiers 0.3.x, built by hand or by ``vf.load_environment``)
            or a v1 ``verifiers.v1.Env`` (verifiers 0.4, e.g. ``vf.SingleAgentEnv(vf.SingleAgentEnvConfig(...))``).
        sampling_args: extra request arguments (``max_tokens``, ``stop``, ...) sent with every model call, on top of
            the environment's own; ``temperature`` and ``top_p`` are the trainer's and may only repeat them.

    Each dataset row is one rollout input: `dataset` returns the environment's own tasks in that form (classic:
    ``prompt``, ``answer``, ``info``, ``example_id``; v1: ``prompt`` and ``task_index``, the task's position in
    the taskset). A classic rubric with group reward functions (scored over all rollouts of a prompt together) is
    refused: the agent door scores each run alone. A rollout that verifiers ends with an error (a refused request,
    a tool failure it does not catch) keeps the reward verifiers scored, and the error is the run's info; a v1
    rollout that failed before it was scored is a failed run.
    """

    def __init__(self, env: Any, sampling_args: dict[str, Any] | None = None):
        classic, classic_client, v1_env = _api()
        if classic is not None and isinstance(env, classic):
            self._play: _Classic | _V1 = _Classic(env, classic_client, sampling_args)
        elif v1_env is not None and isinstance(env, v1_env):
            self._play = _V1(env, sampling_args)
        elif type(env).__module__.startswith("verifiers.v1"):
            import verifiers

            raise TypeError(
                f"VerifiersAgent takes verifiers.v1 environments from verifiers 0.4 on (found verifiers "
                f"{verifiers.__version__}: its v1 preview differs from 0.4's and is not supported)"
            )
        else:
            wanted = " or ".join(
                name
                for name, cls in (("a classic verifiers Environment", classic), ("a verifiers.v1 Env", v1_env))
                if cls is not None
            )
            raise TypeError(f"VerifiersAgent needs {wanted}, got {type(env).__name__}")
        self.env = env
        self.sampling_args = self._play.sampling_args
        self.__name__ = self.__qualname__ = f"VerifiersAgent({type(env).__name__})"

    def dataset(self, n: int = -1, seed: int | None = None):
        """The environment's training dataset, one row per rollout input (``n`` rows, all when -1; shuffled with
        ``seed`` when given)."""
        return self._play.dataset(n, seed)

    async def __call__(self, access: PolicyAccess, row: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        """One rollout of ``row`` with the policy behind ``access`` (the run's URLs and key):
        ``(the environment's reward, info)``."""
        return await self._play(access, row)


class _Classic:
    """The classic API: the environment's ``run_rollout`` with the door's client."""

    def __init__(self, env: Any, client_class: Any, sampling_args: dict[str, Any] | None):
        if env.requires_group_rollouts:
            raise ValueError(
                "VerifiersAgent scores each rollout alone: this environment's rubric has group reward functions "
                f"({', '.join(_names(env.rubric))}), which need all rollouts of a prompt at once"
            )
        self.env, self.client_class = env, client_class
        # the environment's defaults (n=1, extra_body), then the caller's; None values are dropped by verifiers
        self.sampling_args = {**(env.sampling_args or {}), **(sampling_args or {})}
        _check_n(self.sampling_args)

    def dataset(self, n: int, seed: int | None):
        return self.env.get_dataset(n=n, seed=seed)

    async def __call__(self, access: PolicyAccess, row: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        import openai

        client = openai.AsyncOpenAI(base_url=access.base_url, api_key=access.api_key, max_retries=0)
        try:
            output = await self.env.run_rollout(
                dict(row), self.client_class(client), MODEL_NAME, dict(self.sampling_args), max_retries=0
            )
        finally:
            await client.close()
        reward = output.get("reward")
        info = {"metrics": dict(output.get("metrics") or {}), "stop_condition": output.get("stop_condition")}
        if output.get("error"):
            info["error"] = output["error"]
        return (math.nan if reward is None else float(reward)), info


class _V1:
    """The v1 API: verifiers' own episode, its model calls sent to the run's base URL."""

    def __init__(self, env: Any, sampling_args: dict[str, Any] | None):
        import verifiers.v1 as vf
        from verifiers.v1.configs.agent import agent_config_fields

        self.sampling_args = dict(sampling_args or {})
        _check_n(self.sampling_args)
        name = type(env).__name__
        seats = agent_config_fields(env.config)
        if len(seats) != 1:
            raise ValueError(
                f"VerifiersAgent trains one agent seat: {name} declares {len(seats)} ({', '.join(seats)}), and "
                "the door scores each run alone"
            )
        (seat, spec), harness_config = next(iter(seats.items())), next(iter(env.config.agent_harnesses().values()))
        runtime = spec.runtime.type
        if runtime != "subprocess":
            why = _NETWORK_RUNTIMES.get(runtime, "not a local runtime")
            raise ValueError(
                f"VerifiersAgent runs verifiers v1 rollouts offline: seat {seat!r} runs on the {runtime!r} runtime "
                f"({why}); set its runtime to {{'type': 'subprocess'}}"
            )
        if spec.retries.max_retries or spec.retries.rules or env.config.retries.max_retries or env.config.retries.rules:
            raise ValueError(
                "VerifiersAgent cannot retry a verifiers rollout: the policy's answers of a discarded attempt are "
                "already recorded for training (set the env's and the seat's retries to none)"
            )
        taskset = env.taskset
        tools = [*type(taskset).toolsets(taskset.config), *taskset.task_type().toolsets(taskset.config.task)]
        if tools:
            raise ValueError(
                f"VerifiersAgent does not run verifiers tool servers ({', '.join(type(t).__name__ for t in tools)}): "
                "verifiers installs them into uv environments from the network"
            )
        if taskset.config.task.judges:
            raise ValueError(
                "VerifiersAgent does not run verifiers judges: each calls a model endpoint of its own, not the policy"
            )
        harness = vf.load_harness(harness_config)
        if harness.NEEDS_CONTAINER:
            raise ValueError(
                f"VerifiersAgent cannot run harness {harness_config.id!r} offline: it installs a third-party program "
                "from the network and needs a container runtime"
            )
        if type(harness).__module__.startswith("verifiers.v1.harnesses."):  # null, bash: a uv-prepared program
            _prepare_offline(harness, harness_config)
        self.env, self.vf = env, vf
        self.sampling = vf.SamplingConfig(**self.sampling_args)
        self._tasks: dict[int, Any] = {}

    def dataset(self, n: int, seed: int | None):
        from datasets import Dataset

        tasks = self.env.taskset if seed is None else self.env.taskset.shuffle(seed)
        tasks = tasks if n < 0 else tasks.take(n)
        if not tasks.bounded:
            raise ValueError(f"{type(self.env.taskset).__name__} is infinite: ask for n rows (dataset(n=...))")
        rows = []
        for task in tasks:
            self._tasks[task.data.idx] = task
            rows.append({"prompt": task.data.prompt_text, "task_index": task.data.idx})
        return Dataset.from_list(rows)

    def _task(self, index: int) -> Any:
        if index not in self._tasks:
            found = next((task for task in self.env.taskset if task.data.idx == index), None)
            if found is None:
                raise KeyError(f"the taskset has no task {index}")
            self._tasks[index] = found
        return self._tasks[index]

    async def __call__(self, access: PolicyAccess, row: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        if "task_index" not in row:
            raise KeyError("a verifiers v1 row names its task by `task_index` (see VerifiersAgent.dataset)")
        task = self._task(int(row["task_index"]))
        env = copy.copy(self.env)  # its serving resources (interception server) are this run's, in this run's loop
        context = self.vf.ModelContext(
            model=MODEL_NAME,
            # verifiers sends the key of its config (none here) with every request: the run's key is in its URL
            client=self.vf.EvalClientConfig(base_url=access.run_base_url, api_key_var=_UNSET_KEY_VAR),
            sampling=self.sampling,
        )
        async with env.serving():
            episode = await env.run_episode(task, context)
        if not episode.traces:
            raise RuntimeError(f"the verifiers episode failed: {_errors(episode.errors)}")
        if len(episode.traces) > 1:
            raise RuntimeError(
                f"the verifiers episode played its seat {len(episode.traces)} times ({type(self.env).__name__}); "
                "a rollout trains one run: the group is num_generations rollouts"
            )
        trace = episode.traces[0]
        info: dict[str, Any] = {"metrics": dict(trace.metrics), "stop_condition": trace.stop_condition}
        if trace.errors or episode.errors:
            info["error"] = _errors([*trace.errors, *episode.errors])
        scored = [reward for reward in trace.rewards.values() if reward is not None]
        if not scored and info.get("error"):
            raise RuntimeError(f"the verifiers rollout ended before it was scored: {info['error']}")
        info["rewards"] = {key: reward.value for key, reward in trace.rewards.items() if reward is not None}
        return float(trace.reward), info


def _prepare_offline(harness: Any, config: Any) -> None:
    """Prepare a built-in harness's uv program once, offline (verifiers reuses it for every rollout of this process),
    or refuse in one line when its package sources are not local."""
    env = {**os.environ, **config.resolved_env}
    reason = None
    if shutil.which("uv", path=env.get("PATH")) is None:
        reason = "`uv` is not on its PATH, so verifiers would install it from the network"
    elif not (env.get("UV_DEFAULT_INDEX") or env.get("UV_INDEX_URL")):
        reason = "its package index is PyPI (no UV_DEFAULT_INDEX)"
    elif env.get("UV_PYTHON_DOWNLOADS") != "never":
        reason = "uv may download a Python (UV_PYTHON_DOWNLOADS is not `never`)"
    else:
        remote = [key for key in _UV_SOURCES if key in env and not _local(env[key])]
        if remote:
            reason = f"{remote[0]} is not a local folder"
    if reason is None:
        from verifiers.v1 import SubprocessConfig
        from verifiers.v1.runtimes.subprocess import SubprocessRuntime

        async def prepare() -> None:
            runtime = SubprocessRuntime(SubprocessConfig())
            await runtime.start()
            try:
                await harness.setup(runtime)
            finally:
                await runtime.teardown()

        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # its own loop, whether or not the caller runs one
            try:
                pool.submit(asyncio.run, prepare()).result()
            except Exception as err:  # noqa: BLE001 - uv's failure, in one line
                reason = f"uv failed: {str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__}"
    if reason is not None:
        raise ValueError(
            f"VerifiersAgent cannot prepare harness {config.id!r}'s program offline: {reason}; in the harness's env, "
            "put uv on PATH, set UV_DEFAULT_INDEX and UV_FIND_LINKS to local folders and UV_PYTHON_DOWNLOADS=never"
        )


def _local(value: str) -> bool:
    """Whether every source in a uv setting (space-separated, ``name=url`` allowed) is a local path or file URL."""
    urls = [
        part.split("=", 1)[-1] if "=" in part and "://" not in part.split("=", 1)[0] else part for part in value.split()
    ]
    return all(url.startswith("file:") or "://" not in url for url in urls)


def _check_n(sampling_args: dict[str, Any]) -> None:
    if sampling_args.get("n", 1) != 1:
        raise ValueError("VerifiersAgent samples one answer per call (n=1): the group is num_generations runs")


def _errors(errors: Iterable[Any]) -> str:
    return "; ".join(f"{error.type}: {error.message}" for error in errors) or "no error recorded"


def _names(rubric: Any) -> Iterable[str]:
    return [getattr(f, "__name__", repr(f)) for f in getattr(rubric, "funcs", [])]

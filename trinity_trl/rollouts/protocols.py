"""Which environment protocol an environment follows, decided from what its class defines.

Two protocols are trained step-wise by `trinity_trl.trainers.StepGRPOTrainer`:

* **reset/step** (this package's `trinity_trl.rollouts.Environment`): ``reset(**row)`` returns the
  first observation, ``step(action: str)`` returns a `trinity_trl.rollouts.StepResult` with the next
  observation, the reward and ``done``. The model's turns are plain text.
* **tools** (TRL's ``environment_factory`` contract, as ``GRPOTrainer`` documents it): ``reset(**row)``
  returns a string appended to the last user message, or ``None``; every other public method is a tool the
  model calls through the chat template's tool-call format; an optional ``get_reward()`` scores the
  finished run. A turn that calls a tool is a step, the tool results are its observation, a turn without
  a tool call is the final answer.

An environment follows reset/step when it subclasses `trinity_trl.rollouts.Environment` or when its
public methods are exactly ``reset`` and ``step``; any other class with a ``reset`` follows the tool
protocol (a method named ``step`` next to other public methods is then a tool). Methods are read from the
class, like TRL does (``inspect.getmembers(cls, inspect.isfunction)``), so properties are never evaluated.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from .environment import Environment

if TYPE_CHECKING:
    from .generation import Generator
    from .runs import Run

STEP_PROTOCOL = "reset/step"
TOOL_PROTOCOL = "tools"
PROTOCOLS = (STEP_PROTOCOL, TOOL_PROTOCOL)
#: methods of a tool environment that are not tools (TRL's rule)
NOT_TOOLS = ("reset", "get_reward")


def public_methods(cls: type) -> list[str]:
    """Names of the public functions defined on ``cls`` (and its bases), as TRL lists tools."""
    return [name for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction) if not name.startswith("_")]


def tool_names(cls: type) -> list[str]:
    """The tools a TRL-style environment class exposes: its public methods but ``reset`` and ``get_reward``."""
    return [name for name in public_methods(cls) if name not in NOT_TOOLS]


def class_protocol(cls: type) -> str:
    """The protocol ``cls`` follows (see the module docstring); ``TypeError`` naming what is missing."""
    methods = public_methods(cls)
    name = cls.__qualname__
    if "reset" not in methods:
        hint = (
            " (it defines step(): add reset(**row) returning the first observation)"
            if "step" in methods
            else f" (its public methods: {', '.join(methods) or 'none'})"
        )
        raise TypeError(
            f"environment {name} defines no reset(**row): a reset/step environment needs reset() and "
            f"step(action), a TRL tool environment needs reset() and its tools as public methods{hint}"
        )
    if issubclass(cls, Environment) or set(methods) == {"reset", "step"}:
        step = inspect.getattr_static(cls, "step", None)
        if step is None or step is Environment.step:
            raise TypeError(
                f"environment {name} subclasses trinity_trl.rollouts.Environment but does not define "
                "step(action) -> StepResult"
            )
        return STEP_PROTOCOL
    return TOOL_PROTOCOL


def environment_class(factory: Callable[[], Any], name: str | None = None) -> tuple[type, Any]:
    """The class of the environments ``factory`` builds, and the instance built to find it (``None`` when the
    factory is itself a class and nothing had to be built). ``TypeError`` when ``factory`` is not a factory."""
    label = "environment_factory" if name is None else f"environment_factory[{name!r}]"
    if isinstance(factory, type):
        return factory, None
    if not callable(factory):
        raise TypeError(
            f"{label} must be a callable returning a fresh environment (a class or a function), got "
            f"{type(factory).__name__} instance {factory!r:.80}"
        )
    try:
        instance = factory()
    except Exception as err:
        raise TypeError(f"{label}() failed while the trainer probed it: {type(err).__name__}: {err}") from err
    if instance is None or isinstance(instance, type):
        what = "None" if instance is None else f"the class {instance.__qualname__} (not an instance)"
        raise TypeError(f"{label}() must return an environment instance, got {what}")
    return type(instance), instance


def resolve_protocol(
    environment_factory: Callable | dict[str, Callable] | None,
    tools: Iterable | None = None,
    columns: Iterable[str] | None = None,
) -> tuple[str, dict[str | None, type]]:
    """Check ``environment_factory`` (a factory or a dict of factories, TRL's contract) and ``tools``, and
    return ``(protocol, {environment name: class})``; one-line ``TypeError``/``ValueError`` otherwise.

    ``columns``: the training dataset's columns, when known; every ``reset`` must accept them as keyword
    arguments (the reset/step protocol receives every column but ``prompt``; TRL's tool protocol every
    column, ``environment`` excepted when a dict routes the rows).
    """
    tools = list(tools or [])
    bad = [t for t in tools if not callable(t)]
    if bad:
        raise TypeError(f"tools must be callables (functions with type hints and a docstring), got {bad[0]!r:.80}")
    if environment_factory is None:
        if tools:
            return TOOL_PROTOCOL, {}
        raise ValueError(
            "StepGRPOTrainer needs environment_factory (a callable returning a fresh environment, or a "
            "dict of them routed by the dataset's 'environment' column), tools, or agent= (an `async def "
            "agent(client, row)` calling the policy through an OpenAI client)"
        )
    routed = isinstance(environment_factory, dict)
    if routed and not environment_factory:
        raise ValueError("environment_factory is an empty dict: map each 'environment' value to a factory")
    factories = dict(environment_factory) if routed else {None: environment_factory}
    classes, protocols = {}, {}
    for name, factory in factories.items():
        cls, instance = environment_class(factory, name)
        close = getattr(instance, "close", None)
        if callable(close):  # the probe's resources (a server session) are not kept
            close()
        classes[name], protocols[name] = cls, class_protocol(cls)
    kinds = set(protocols.values())
    if len(kinds) > 1:
        listing = ", ".join(f"{n!r}: {classes[n].__qualname__} ({p})" for n, p in protocols.items())
        raise ValueError(f"all environments of one trainer follow one protocol, got {listing}")
    protocol = kinds.pop()
    if protocol == STEP_PROTOCOL and tools:
        raise ValueError(
            f"tools= needs TRL's tool protocol, but {next(iter(classes.values())).__qualname__} is a "
            "reset/step environment (its step() reads text): drop tools=, or make the tools public "
            "methods of a tool environment"
        )
    if columns is not None:
        skip = {"prompt", "environment"} if protocol == STEP_PROTOCOL else ({"environment"} if routed else set())
        for cls in classes.values():
            check_reset_accepts(cls, [c for c in columns if c not in skip])
    return protocol, classes


def check_reset_accepts(cls: type, columns: list[str]) -> None:
    """``TypeError`` naming the columns ``cls.reset`` cannot take as keyword arguments."""
    reset = inspect.getattr_static(cls, "reset")
    reset = getattr(reset, "__func__", reset)
    try:
        parameters = inspect.signature(reset).parameters.values()
    except (TypeError, ValueError):  # builtins and C extensions: nothing to check
        return
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        names = None
    else:
        names = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    missing = [c for c in columns if names is not None and c not in names]
    if missing:
        raise TypeError(
            f"{cls.__qualname__}.reset() is called with every dataset column as a keyword argument but "
            f"does not accept {missing}: add them (or **row) to its signature"
        )
    required = [
        p.name
        for p in parameters
        if p.default is p.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and p.name != "self"
        and p.name not in columns
    ]
    if required:
        raise TypeError(
            f"{cls.__qualname__}.reset() requires {required}, which the dataset has no columns for "
            f"(columns: {list(columns)})"
        )


# ---------------------------------------------------------------------------------------------------- rollouts
def environment_reward(completions, env_reward, **kwargs) -> list[float | None]:
    """The reward a played run returned (a reset/step environment's last-step reward, an agent's return value):
    ``None`` where it could not score the run, or returned a non-finite number (TRL's convention, so the run is
    unscorable rather than rewarded 0, and kept out of the logged means). The first reward function of every
    `PlayedRollout`."""
    return [None if reward is None or not math.isfinite(reward) else reward for reward in env_reward]


@dataclass
class RolloutContext:
    """What a rollout may use of its trainer once TRL has built it (`Rollout.start`).

    Attributes:
        generation: the trainer's generation backend (`trinity_trl.rollouts.generation.Generator`).
        processing_class: the trainer's tokenizer or processor (the policy's chat template).
        tokenizer: its tokenizer.
        chat_template: the chat template the trainer renders with (``None``: the tokenizer's own).
        chat_template_kwargs: extra arguments of the chat template.
        tools: TRL's tools (a tool environment's methods and the standalone ``tools``), as TRL keeps them.
        max_context: prompt tokens at most (the model's context less ``max_completion_length``), or ``None``.
        max_completion_length: completion tokens the generation backend samples at most, or ``None``.
        sampling: the trainer's sampling settings (``temperature``, ``top_p``).
        policy_version: returns the number of optimizer steps the generation backend's weights have taken (the
            trainer's ``global_step``), or ``None``.
        lockstep_engine: the engine's name when every process must generate in lockstep (DeepSpeed ZeRO-3, FSDP
            gather the sharded weights in every forward), else ``None``.
    """

    generation: Generator
    processing_class: Any
    tokenizer: Any
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    tools: list[Callable] | None = None
    max_context: int | None = None
    sampling: dict[str, float | None] = field(default_factory=dict)
    lockstep_engine: str | None = None
    max_completion_length: int | None = None
    policy_version: Callable[[], int] | None = None


#: ``trl_generate(inputs, **attributes)``: TRL's ``_generate_and_score_completions`` of ``inputs``, with some of the
#: trainer's attributes (``rollout_func``, ``mask_truncated_completions``) set for the call
TrlGenerate = Callable[..., dict[str, Any]]


@runtime_checkable
class Rollout(Protocol):
    """How `trinity_trl.trainers.StepGRPOTrainer` gets whole runs for a batch of task rows.

    One implementation per kind of environment: `trinity_trl.rollouts.MultiStepRollout` (reset/step environments),
    `trinity_trl.rollouts.ToolRollout` (TRL's tool environments) and `trinity_trl.rollouts.AgentRollout` (agents over
    the policy endpoint). The trainer calls these methods and reads these attributes, nothing else: another kind of
    environment is another class passed as ``StepGRPOTrainer(rollout=...)``, with no change to the trainer.

    Attributes:
        protocol: a name for people (the model card, logs, tests); the trainer never compares it.
        environment_names: what the model card names as the environment.
        max_env_steps: turns (model calls) per run at most; the trainer checks it equals its config's ``max_env_steps``.
        history: ``"tokens"`` or ``"messages"``, as the config's ``history``.
        metrics: this process's metrics of the last generation (``{}``: none), logged as they are named; a name ending
            in ``_per_run`` is a mean over runs (averaged over processes), any other a count (summed).
    """

    protocol: str
    environment_names: list[str]
    max_env_steps: int
    history: str
    metrics: dict[str, float]

    def trl_arguments(self, given: dict[str, Any], reward_funcs: list[Callable]) -> dict[str, Any]:
        """TRL's ``GRPOTrainer`` keyword arguments: ``given`` (the user's) with this rollout's reward functions (built
        on ``reward_funcs``, the user's), environments and tools, or a placeholder ``train_dataset``."""

    def start(self, context: RolloutContext) -> None:
        """Called once, when TRL's trainer exists: take what the rollout needs of it; refuse (one line) what it cannot
        run under."""

    def generate(self, inputs: list[dict[str, Any]], trl_generate: TrlGenerate) -> dict[str, Any]:
        """TRL's scored output for one generation batch of task rows (``inputs``), through ``trl_generate``."""

    def runs(self, output: dict[str, Any], inputs: list[dict[str, Any]], rewards: list[float]) -> list[Run]:
        """This process's runs of the batch, whole (one per row of ``output``, in order); ``rewards``: their rewards as
        TRL weighed them (NaN: unscored)."""


class PlayedRollout:
    """Base of the rollouts that play their runs themselves (reset/step environments, agents): subclasses define
    ``__call__(rows) -> list[Run]``. TRL receives each run's last turn through its ``rollout_func`` and scores it, with
    `environment_reward` (the run's own reward) first among the reward functions; the runs come back whole in each
    row's ``run`` field."""

    protocol: str
    environment_names: list[str]
    max_env_steps: int
    history: str
    metrics: dict[str, float]

    def __call__(self, rows: list[dict[str, Any]]) -> list[Run]:
        raise NotImplementedError

    def trl_arguments(self, given: dict[str, Any], reward_funcs: list[Callable]) -> dict[str, Any]:
        return given | {"reward_funcs": [environment_reward, *reward_funcs]}

    def generate(self, inputs: list[dict[str, Any]], trl_generate: TrlGenerate) -> dict[str, Any]:
        rows = [dict(row) for row in inputs]
        # TRL reads x["prompt"] before calling the rollout; tasks may get their whole prompt from reset()
        for row in inputs:
            row.setdefault("prompt", [{"role": "user", "content": ""}])
        # TRL's rollout_func receives only the prompts; the runs need the whole rows
        return trl_generate(inputs, rollout_func=functools.partial(self.report, rows))

    def report(self, rows: list[dict[str, Any]], prompts, trainer) -> dict[str, list]:
        """TRL's ``rollout_func`` for one batch: play every run and report each run's final turn (which TRL scores),
        and the whole runs (``run``)."""
        runs = self(rows)
        last = [run.steps[-1] for run in runs]
        logprobs = [s.logprobs for s in last]
        return {
            "prompt_ids": [s.prompt_ids for s in last],
            "completion_ids": [s.completion_ids for s in last],
            "logprobs": None if any(lp is None for lp in logprobs) else logprobs,
            "env_reward": [run.reward for run in runs],
            "run": runs,
        }

    def runs(self, output: dict[str, Any], inputs: list[dict[str, Any]], rewards: list[float]) -> list[Run]:
        return [row["run"] for row in inputs]


ROLLOUT_METHODS = ("trl_arguments", "start", "generate", "runs")
ROLLOUT_ATTRIBUTES = ("protocol", "environment_names", "max_env_steps", "history", "metrics")


def check_rollout(rollout: Any, max_env_steps: int, history: str) -> None:
    """One-line ``TypeError``/``ValueError`` unless ``rollout`` follows `Rollout` and plays by the trainer's
    ``max_env_steps`` and ``history``."""
    name = type(rollout).__qualname__
    missing = [m for m in ROLLOUT_METHODS if not callable(getattr(rollout, m, None))]
    missing += [a for a in ROLLOUT_ATTRIBUTES if not hasattr(rollout, a)]
    if missing:
        raise TypeError(
            f"rollout= must follow trinity_trl.rollouts.Rollout (methods {', '.join(ROLLOUT_METHODS)}; attributes "
            f"{', '.join(ROLLOUT_ATTRIBUTES)}): {name} lacks {', '.join(missing)}"
        )
    if rollout.max_env_steps != max_env_steps:
        raise ValueError(
            f"rollout {name} plays max_env_steps={rollout.max_env_steps} turns per run but the config says "
            f"max_env_steps={max_env_steps}: make them equal"
        )
    if rollout.history != history:
        raise ValueError(
            f"rollout {name} extends the history by {rollout.history!r} but the config says history={history!r}: "
            "make them equal"
        )

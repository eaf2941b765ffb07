"""Play multi-step episodes with a trainer's generation backend, one sample per turn.

All runs that are still active generate their next turn in ONE batched call to the trainer's
generation backend (`trinity_trl.rollouts.generation.Generator`: TRL's transformers
``generate``, continuous batching or vLLM, whichever the trainer is configured for). Each turn is
recorded as a ``Step``: the prompt is the whole
conversation so far, the completion is the model's turn.

Two ways to extend the history after a turn (``history``):

* ``"tokens"`` (default): next prompt = previous prompt + the generated tokens (+ EOS if the turn
  was cut off) + the chat-template tokens of the observation. The history is never re-tokenized, so
  every step's prompt extends the previous step's prompt + completion exactly (prefix-preserving),
  which lets the trainer train a whole run in one forward pass.
* ``"messages"``: the conversation is re-rendered by the chat template every turn (templates may
  rewrite earlier turns, e.g. strip reasoning); prefix preservation is then checked per run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from .environment import EnvironmentFailure, StepResult
from .generation import Generator
from .protocols import STEP_PROTOCOL, PlayedRollout, RolloutContext
from .runs import Run, Step, declared_state, declared_step_reward, observation_state, prompt_state

__all__ = ["HISTORY_MODES", "MultiStepRollout", "Run", "Step"]

HISTORY_MODES = ("tokens", "messages")


def _describe(row: dict[str, Any], limit: int = 80) -> str:
    text = ", ".join(f"{k}={v!r}" for k, v in row.items() if k != "prompt")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _initial_messages(row: dict[str, Any], observation: str | None) -> list[dict[str, Any]]:
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}] if prompt else []
    else:
        messages = [dict(m) for m in (prompt or []) if m.get("content") or m.get("role") != "user"]
    if observation:
        if messages and messages[-1]["role"] == "user":
            messages[-1]["content"] = f"{messages[-1]['content']}\n\n{observation}"
        else:
            messages.append({"role": "user", "content": observation})
    if not messages:
        raise ValueError("a run needs a prompt: the dataset row has no 'prompt' and reset() returned no observation")
    return messages


class MultiStepRollout(PlayedRollout):
    """The `trinity_trl.rollouts.protocols.Rollout` of reset/step environments: plays ``len(rows)`` episodes in
    lockstep with a generation backend and returns them whole.

    Args:
        generator: the generation backend (chat template, tokenizer and sampling settings); ``None``: the trainer's,
            given by `start`.
        environment_factory: builds a fresh environment per run; or a dict of factories, each row choosing
            one by its ``environment`` column (not passed to ``reset``), as TRL routes its environments.
        max_env_steps: turns per run at most (a run still going then ends, ``cut``; see `Run`).
        history: ``"tokens"`` or ``"messages"`` (see the module docstring).
        environment_names: what the model card names as the environment.

    An environment's failure (``reset`` or ``step`` raising, ``step`` returning something else than a
    `StepResult`, or no observation for a run that goes on) stops the rollout with an
    `EnvironmentFailure` naming the run, its row and the turn. A step reward of ``None`` means "cannot
    score": the run's reward becomes NaN, and the trainer counts it and gives its steps no gradient. An
    environment that defines ``close()`` is closed when its run ends.
    """

    protocol = STEP_PROTOCOL

    def __init__(
        self,
        generator: Generator | None,
        environment_factory: Callable[[], Any] | dict[str, Callable[[], Any]],
        max_env_steps: int | None = None,
        history: str = "tokens",
        environment_names: Iterable[str] = (),
        *,
        max_steps: int | None = None,
    ):
        if max_steps is not None:  # its name until 0.1: it clashed with the training length (issue 37)
            raise TypeError(
                "MultiStepRollout's max_steps is now max_env_steps (turns per run at most, as in the config)"
            )
        if max_env_steps is None:
            raise TypeError("MultiStepRollout needs max_env_steps (turns per run at most)")
        if max_env_steps < 1:
            raise ValueError(f"max_env_steps must be >= 1, got {max_env_steps}")
        if history not in HISTORY_MODES:
            raise ValueError(f"history must be one of {HISTORY_MODES}, got {history!r}")
        self.generator = generator
        self.environment_factory = environment_factory
        self.max_env_steps = max_env_steps
        self.history = history
        self.environment_names = list(environment_names)
        self.metrics: dict[str, float] = {}

    @classmethod
    def for_environments(cls, environment_factory, tools, max_env_steps: int, history: str, names) -> MultiStepRollout:
        """The trainer's rollout of ``environment_factory`` (checked by `trinity_trl.rollouts.resolve_protocol`; no
        ``tools``), over the generation backend `start` gives it."""
        return cls(None, environment_factory, max_env_steps, history, names)

    def trl_arguments(self, given: dict[str, Any], reward_funcs: list[Callable]) -> dict[str, Any]:
        if given.get("train_dataset") is None:
            given = given | {"train_dataset": self._placeholder_tasks(given.get("args"))}
        return super().trl_arguments(given, reward_funcs)

    def _placeholder_tasks(self, args):
        """``train_dataset=None`` (the environment owns the data): rows of empty prompts that drive the loop while
        ``reset`` supplies each task, the same placeholder TRL builds for its own environments."""
        from datasets import Dataset

        if isinstance(self.environment_factory, dict):
            raise ValueError(
                "a dict environment_factory routes rows by their 'environment' column: it needs a "
                "train_dataset with that column"
            )
        if args is None or args.max_steps <= 0:
            raise ValueError(
                "train_dataset=None (the environment owns the data) needs max_steps > 0 to set the training length"
            )
        return Dataset.from_dict(
            {"prompt": [[{"role": "user", "content": ""}]] * (args.generation_batch_size // args.num_generations)}
        )

    def start(self, context: RolloutContext) -> None:
        if self.generator is None:
            self.generator = context.generation

    def _start(self, index: int, row: dict[str, Any]) -> tuple[Any, Run, str]:
        factory = self.environment_factory
        kwargs = {k: v for k, v in row.items() if k != "prompt"}
        if isinstance(factory, dict):
            name = kwargs.pop("environment", None)
            if name not in factory:
                raise EnvironmentFailure(
                    f"run {index} ({_describe(row)}): environment={name!r} is not among the "
                    f"environments passed to environment_factory: {list(factory)}"
                )
            factory = factory[name]
        env = factory()
        try:
            observation = env.reset(**kwargs)
        except Exception as err:
            raise EnvironmentFailure(
                f"run {index} ({_describe(row)}): {type(env).__name__}.reset() failed: {type(err).__name__}: {err}"
            ) from err
        # the state the first turn acts from: the reset observation, else the row's prompt (GiGPO's anchor state)
        state = prompt_state(row.get("prompt")) if observation is None else observation_state(observation)
        return env, Run(messages=_initial_messages(row, observation)), state

    def __call__(self, rows: list[dict[str, Any]]) -> list[Run]:
        generator = self.generator
        if generator is None:
            raise RuntimeError("MultiStepRollout has no generator: pass one, or let StepGRPOTrainer start() it")
        runs, environments, states = [], [], []
        for index, row in enumerate(rows):
            env, run, state = self._start(index, row)
            runs.append(run)
            environments.append(env)
            states.append(state)
        prompts = generator.tokenize_conversations([run.messages for run in runs])
        try:
            for turn in range(self.max_env_steps):
                active = [i for i, run in enumerate(runs) if not run.done]
                if not active:
                    break
                completions, logprobs = generator.generate([prompts[i] for i in active])
                for j, i in enumerate(active):
                    run, completion = runs[i], list(completions[j])
                    text = generator.decode(completion)
                    where = f"run {i} ({_describe(rows[i])}), turn {turn}"
                    result = self._step(environments[i], text, where)
                    reward = math.nan if result.reward is None else float(result.reward)
                    try:
                        step_reward = declared_step_reward(result.info)
                    except ValueError as err:
                        raise EnvironmentFailure(f"{where}: {type(environments[i]).__name__}.step(): {err}") from err
                    run.steps.append(
                        Step(
                            prompts[i],
                            completion,
                            logprobs[j] if logprobs is not None else None,
                            reward,
                            text,
                            state_key=states[i],
                            step_reward=step_reward,
                        )
                    )
                    states[i] = declared_state(result.info, result.observation)
                    run.reward = reward
                    if result.done:
                        run.done = True
                        self._close(environments[i])
                    elif turn == self.max_env_steps - 1:
                        run.done, run.cut = True, True
                        self._close(environments[i])
                    elif result.observation is None:  # the run goes on, so the model needs something to read
                        raise EnvironmentFailure(
                            f"{where}: {type(environments[i]).__name__}.step() returned no "
                            "observation for an episode that is not done"
                        )
                    else:
                        prompts[i] = self._next_prompt(run, prompts[i], completion, text, result.observation)
        finally:
            for env, run in zip(environments, runs):
                if not run.done:
                    self._close(env)
        return runs

    @staticmethod
    def _step(env: Any, text: str, where: str) -> StepResult:
        try:
            result = env.step(text)
        except Exception as err:
            raise EnvironmentFailure(
                f"{where}: {type(env).__name__}.step() failed: {type(err).__name__}: {err}"
            ) from err
        if not isinstance(result, StepResult):
            raise EnvironmentFailure(
                f"{where}: {type(env).__name__}.step() must return a StepResult, got {type(result).__name__}"
            )
        return result

    @staticmethod
    def _close(env: Any) -> None:
        close = getattr(env, "close", None)
        if callable(close):
            close()

    def _next_prompt(
        self, run: Run, prompt: list[int], completion: list[int], text: str, observation: str
    ) -> list[int]:
        run.messages += [{"role": "assistant", "content": text}, {"role": "user", "content": observation}]
        generator = self.generator
        history = (
            prompt
            + completion
            + ([] if completion and completion[-1] in generator.eos_token_ids else [generator.eos_token_id])
        )
        if self.history == "tokens":
            return history + self._observation_ids(observation)
        rendered = generator.tokenize_conversations([run.messages])[0]
        if rendered[: len(prompt) + len(completion)] != prompt + completion:
            run.prefix_preserving = False
        return rendered

    def _observation_ids(self, observation: str) -> list[int]:
        """Chat-template tokens that follow an assistant turn's EOS: the user observation and the
        next generation prompt. Found by rendering a dummy exchange with and without it."""
        generator = self.generator
        dummy = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
        render = generator.render

        prefix = render(dummy, False)
        full = render(dummy + [{"role": "user", "content": observation}], True)
        eos_positions = [i for i, token in enumerate(prefix) if token == generator.eos_token_id]
        if eos_positions:  # templates render "<eos>\n" after a turn; the generated turn ends at <eos>
            prefix = prefix[: eos_positions[-1] + 1]
        if full[: len(prefix)] != prefix:
            raise ValueError(
                "the chat template does not extend a conversation by appending tokens; use history='messages'"
            )
        return full[len(prefix) :]

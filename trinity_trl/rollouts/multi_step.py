"""Play multi-step episodes with a trainer's generation backend, one sample per turn.

All runs that are still active generate their next turn in ONE batched call to the trainer's
generation backend (:class:`~trinity_trl.rollouts.generation.Generator`: TRL's transformers
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

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .environment import StepResult
from .generation import Generator

HISTORY_MODES = ("tokens", "messages")


@dataclass
class Step:
    """One turn: ``prompt_ids`` (conversation so far), ``completion_ids`` (the model's turn)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float] | None
    reward: float
    text: str


@dataclass
class Run:
    """One episode. ``reward`` is the reward of the last step; ``prefix_preserving`` says whether
    every step's prompt starts with the previous step's prompt + completion."""

    steps: list[Step] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    prefix_preserving: bool = True
    messages: list[dict[str, Any]] = field(default_factory=list)


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


class MultiStepRollout:
    """Plays ``len(rows)`` episodes in lockstep with a generation backend.

    Args:
        generator: the generation backend (chat template, tokenizer and sampling settings).
        environment_factory: builds a fresh environment per run.
        max_steps: turns per run at most.
        history: ``"tokens"`` or ``"messages"`` (see the module docstring).
    """

    def __init__(self, generator: Generator, environment_factory: Callable[[], Any], max_steps: int,
                 history: str = "tokens"):
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        if history not in HISTORY_MODES:
            raise ValueError(f"history must be one of {HISTORY_MODES}, got {history!r}")
        self.generator = generator
        self.environment_factory = environment_factory
        self.max_steps = max_steps
        self.history = history

    def __call__(self, rows: list[dict[str, Any]]) -> list[Run]:
        generator = self.generator
        runs, environments = [], []
        for row in rows:
            env = self.environment_factory()
            messages = _initial_messages(row, env.reset(**{k: v for k, v in row.items() if k != "prompt"}))
            runs.append(Run(messages=messages))
            environments.append(env)
        prompts = generator.tokenize_conversations([run.messages for run in runs])
        for turn in range(self.max_steps):
            active = [i for i, run in enumerate(runs) if not run.done]
            if not active:
                break
            completions, logprobs = generator.generate([prompts[i] for i in active])
            for j, i in enumerate(active):
                run, completion = runs[i], list(completions[j])
                text = generator.decode(completion)
                result = environments[i].step(text)
                if not isinstance(result, StepResult):
                    raise TypeError(f"environment.step must return a StepResult, got {type(result).__name__}")
                run.steps.append(Step(prompts[i], completion, logprobs[j] if logprobs is not None else None,
                                      float(result.reward), text))
                run.reward = float(result.reward)
                if result.done or turn == self.max_steps - 1:
                    run.done = True
                    continue
                if result.observation is None:
                    raise ValueError("environment.step returned no observation for an episode that is not done")
                prompts[i] = self._next_prompt(run, prompts[i], completion, text, result.observation)
        return runs

    def _next_prompt(self, run: Run, prompt: list[int], completion: list[int], text: str, observation: str) -> list[int]:
        run.messages += [{"role": "assistant", "content": text}, {"role": "user", "content": observation}]
        generator = self.generator
        history = prompt + completion + ([] if completion and completion[-1] in generator.eos_token_ids
                                         else [generator.eos_token_id])
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
            raise ValueError("the chat template does not extend a conversation by appending tokens; use history='messages'")
        return full[len(prefix):]

"""Turn a tool-calling trajectory into a run of steps, one step per assistant turn.

TRL's tool loop (``GRPOTrainer`` with ``tools`` or a tool ``environment_factory``) returns one completion per
run: the model's turns with the tool results in between, concatenated as token ids (never re-tokenized), and
a mask that is 1 on the model's tokens and 0 on the tool results' chat-template tokens. Each maximal block of
model tokens is one assistant turn: turn ``k``'s prompt is the run's prompt + everything before the block, its
completion is the block. Every step's prompt therefore extends the previous step's prompt + completion exactly.

`ToolRollout` is the `trinity_trl.rollouts.protocols.Rollout` of TRL's tool environments: TRL plays the runs, and it
reads them back, whole, from TRL's output.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .protocols import TOOL_PROTOCOL, RolloutContext, TrlGenerate
from .runs import Run, Step, tokens_state


def turn_spans(model_token_mask: Sequence[int]) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` of the maximal blocks of 1s in ``model_token_mask`` (one per assistant turn)."""
    spans, start = [], None
    for i, value in enumerate(model_token_mask):
        if value and start is None:
            start = i
        elif not value and start is not None:
            spans.append((start, i))
            start = None
    if start is not None:
        spans.append((start, len(model_token_mask)))
    return spans


def run_from_trajectory(
    prompt_ids: Sequence[int],
    completion_ids: Sequence[int],
    model_token_mask: Sequence[int],
    logprobs: Sequence[float] | None = None,
    reward: float = 0.0,
) -> Run:
    """One `Run` whose steps are the assistant turns of a tool-calling trajectory.

    Args:
        prompt_ids: the run's first prompt (chat template with the tools, ending with the generation prompt).
        completion_ids: ``(T,)`` every token after it: the turns and the tool results between them.
        model_token_mask: ``(T,)`` 1 where the model sampled the token, 0 on tool-result tokens.
        logprobs: ``(T,)`` the sampling log-probs (any value on tool tokens), or ``None`` when unknown.
        reward: the run's reward (every step carries it; step-wise advantages only read the run's).
    """
    if len(model_token_mask) != len(completion_ids):
        raise ValueError(
            f"model_token_mask has {len(model_token_mask)} entries for {len(completion_ids)} completion tokens"
        )
    if logprobs is not None and len(logprobs) != len(completion_ids):
        raise ValueError(f"logprobs has {len(logprobs)} entries for {len(completion_ids)} completion tokens")
    prompt, completion = list(prompt_ids), list(completion_ids)
    spans = turn_spans(model_token_mask) or [(0, len(completion))]  # no model token: one (empty) turn
    # the state a turn acts from (GiGPO's anchor state): the first turn's prompt (the row's prompt with what reset
    # returned), then the tool results the previous turn got back
    previous_ends = [None] + [end for _, end in spans[:-1]]
    steps = [
        Step(
            prompt + completion[:start],
            completion[start:end],
            None if logprobs is None else [float(x) for x in logprobs[start:end]],
            reward,
            "",
            state_key=tokens_state("prompt_ids", prompt)
            if before is None
            else tokens_state("tool_result_ids", completion[before:start]),
        )
        for (start, end), before in zip(spans, previous_ends)
    ]
    return Run(steps=steps, reward=reward, done=True, prefix_preserving=True)


#: how a tool run's last turn ended (`ToolRollout.endings`)
ENDINGS = ("answer", "tool_call", "malformed")


class ToolRollout:
    """The `trinity_trl.rollouts.protocols.Rollout` of TRL's tool environments (``environment_factory`` and ``tools``
    exactly as ``GRPOTrainer`` takes them).

    TRL plays the runs itself (its environment pool, ``reset``, chat template with the tool schemas, tool-call
    parsing, tool execution and errors, ``get_reward``); `runs` splits each trajectory of TRL's output into one step
    per assistant turn (`run_from_trajectory`), with TRL's reward, and marks how it ended (`endings`).

    Args:
        environment_factory: TRL's ``environment_factory`` (a factory or a dict of them), or ``None`` (tools only).
        tools: standalone tools (callables), or ``None``.
        max_env_steps: turns per run at most; TRL's own limit, ``max_tool_calling_iterations``, is
            ``max_env_steps - 1`` (`trinity_trl.trainers.StepGRPOConfig` keeps them so).
        history: ``"tokens"`` only (TRL's tool loop always extends the token history).
        environment_names: what the model card names as the environment.
    """

    protocol = TOOL_PROTOCOL

    def __init__(
        self,
        environment_factory: Callable | dict[str, Callable] | None,
        tools: Iterable[Callable] | None,
        max_env_steps: int,
        history: str = "tokens",
        environment_names: Iterable[str] = (),
    ):
        if history != "tokens":
            raise ValueError(
                "history='messages' is for reset/step environments; TRL's tool loop always extends "
                "the token history (set history='tokens')"
            )
        self.environment_factory, self.tools = environment_factory, tools
        self.max_env_steps, self.history = max_env_steps, history
        self.environment_names = list(environment_names)
        self.metrics: dict[str, float] = {}
        self.tokenizer: Any = None
        self.trl_tools: list[Callable] | None = None

    @classmethod
    def for_environments(cls, environment_factory, tools, max_env_steps: int, history: str, names) -> ToolRollout:
        """The trainer's rollout of ``environment_factory`` and ``tools`` (checked by
        `trinity_trl.rollouts.resolve_protocol`)."""
        return cls(environment_factory, tools, max_env_steps, history, names)

    def trl_arguments(self, given: dict[str, Any], reward_funcs: list[Callable]) -> dict[str, Any]:
        # TRL sets up the environments (pool, tools, get_reward, response parsing, chat template)
        return given | {
            "reward_funcs": reward_funcs or None,
            "environment_factory": self.environment_factory,
            "tools": self.tools,
        }

    def start(self, context: RolloutContext) -> None:
        self.tokenizer, self.trl_tools = context.tokenizer, context.tools

    def generate(self, inputs: list[dict[str, Any]], trl_generate: TrlGenerate) -> dict[str, Any]:
        # TRL plays the tool loop. Its mask_truncated_completions would zero the whole trajectory (and the turn
        # boundaries in its tool_mask) when the last turn is cut off; the trainer masks each step on its own, so TRL's
        # whole-run masking is off during its call
        return trl_generate(inputs, mask_truncated_completions=False)

    def runs(self, output: dict[str, Any], inputs: list[dict[str, Any]], rewards: list[float]) -> list[Run]:
        runs = runs_from_output(output)
        for run, ending, reward in zip(runs, self.endings(runs), rewards):
            run.cut, run.malformed, run.reward = ending == "tool_call", ending == "malformed", reward
        return runs

    def endings(self, runs: list[Run]) -> list[str]:
        """How each tool run ended, its last turn parsed as TRL parses turns (``parse_response``): ``"answer"`` (no
        tool call), ``"tool_call"`` (still calling a tool: stopped by ``max_env_steps`` or ``max_completion_length``)
        or ``"malformed"`` (the response template's tool-call opener is there but TRL's parser found no valid call,
        so TRL took the turn as the final answer: the run ends there, scored as it is)."""
        from trl.chat_template_utils import parse_response

        tokenizer = self.tokenizer
        template = getattr(tokenizer, "response_template", None)
        if template is None and getattr(tokenizer, "response_schema", None) is None:
            return ["answer"] * len(runs)
        field = (template or {}).get("fields", {}).get("tool_calls", {})
        opener = field.get("open_pattern") or (re.escape(field["open"]) if field.get("open") else None)
        endings = []
        for run in runs:
            last = run.steps[-1]
            if parse_response(tokenizer, last.completion_ids, prefix=last.prompt_ids, tools=self.trl_tools).get(
                "tool_calls"
            ):
                endings.append("tool_call")
            elif opener is not None and re.search(opener, tokenizer.decode(last.completion_ids)):
                endings.append("malformed")
            else:
                endings.append("answer")
        return endings


def runs_from_output(output: dict[str, Any]) -> list[Run]:
    """The runs of TRL's tool loop in one process's output, one step per assistant turn: its padded prompt /
    completion / tool-mask rows (``prompt_ids``, ``prompt_mask``, ``completion_ids``, ``completion_mask``,
    ``tool_mask``, ``sampling_per_token_logps``: ``(N, P)`` and ``(N, C)`` tensors) back to the token lists it
    generated."""
    prompt_lengths = output["prompt_mask"].sum(1).tolist()
    completion_lengths = output["completion_mask"].sum(1).tolist()  # unmasked: see ToolRollout.generate
    tool_mask = output.get("tool_mask")
    sampled = output.get("sampling_per_token_logps")
    runs = []
    for i, (p, c) in enumerate(zip(prompt_lengths, completion_lengths)):
        prompt = output["prompt_ids"][i, output["prompt_ids"].size(1) - p :].tolist()
        completion = output["completion_ids"][i, :c].tolist()
        mask = [1] * c if tool_mask is None else tool_mask[i, :c].tolist()
        logps = None if sampled is None else sampled[i, :c].tolist()
        runs.append(run_from_trajectory(prompt, completion, mask, logps))
    return runs

"""Turn a tool-calling trajectory into a run of steps, one step per assistant turn.

TRL's tool loop (``GRPOTrainer`` with ``tools`` or a tool ``environment_factory``) returns one completion per
run: the model's turns with the tool results in between, concatenated as token ids (never re-tokenized), and
a mask that is 1 on the model's tokens and 0 on the tool results' chat-template tokens. Each maximal block of
model tokens is one assistant turn: turn ``k``'s prompt is the run's prompt + everything before the block, its
completion is the block. Every step's prompt therefore extends the previous step's prompt + completion exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

from .multi_step import Run, Step


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
    steps = [
        Step(
            prompt + completion[:start],
            completion[start:end],
            None if logprobs is None else [float(x) for x in logprobs[start:end]],
            reward,
            "",
        )
        for start, end in spans
    ]
    return Run(steps=steps, reward=reward, done=True, prefix_preserving=True)

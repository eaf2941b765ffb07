"""A tool-calling trajectory (TRL's concatenated ids and tool mask) split into one step per assistant turn."""

from __future__ import annotations

import pytest

from trinity_trl.rollouts import run_from_trajectory
from trinity_trl.rollouts.trajectories import turn_spans


def test_turn_spans():
    assert turn_spans([1, 1, 0, 0, 1, 0, 1, 1]) == [(0, 2), (4, 5), (6, 8)]
    assert turn_spans([0, 1]) == [(1, 2)] and turn_spans([]) == []


def test_each_block_of_model_tokens_is_a_step_whose_prompt_extends_the_previous_turn():
    prompt = [1, 2]
    completion = [10, 11, 90, 91, 20, 92, 30, 31]  # turn, tool result, turn, tool result, turn
    mask = [1, 1, 0, 0, 1, 0, 1, 1]
    logps = [-0.1, -0.2, 0.0, 0.0, -0.3, 0.0, -0.4, -0.5]
    run = run_from_trajectory(prompt, completion, mask, logps, reward=0.5)
    assert [(s.prompt_ids, s.completion_ids, s.logprobs) for s in run.steps] == [
        ([1, 2], [10, 11], [-0.1, -0.2]),
        ([1, 2, 10, 11, 90, 91], [20], [-0.3]),
        ([1, 2, 10, 11, 90, 91, 20, 92], [30, 31], [-0.4, -0.5]),
    ]
    assert run.reward == 0.5 and run.prefix_preserving and run.done
    # the state each turn acted from (GiGPO): the run's prompt, then the tool results the previous turn got back
    assert [s.state_key for s in run.steps] == ["prompt_ids:1,2", "tool_result_ids:90,91", "tool_result_ids:92"]
    assert all(s.step_reward is None for s in run.steps)  # TRL's tool loop declares no step rewards
    for before, after in zip(run.steps, run.steps[1:]):
        assert (
            after.prompt_ids[: len(before.prompt_ids) + len(before.completion_ids)]
            == before.prompt_ids + before.completion_ids
        )


def test_a_single_turn_and_unknown_log_probs():
    run = run_from_trajectory([1], [5, 6], [1, 1])
    assert len(run.steps) == 1 and run.steps[0].completion_ids == [5, 6] and run.steps[0].logprobs is None


def test_lengths_must_agree():
    with pytest.raises(ValueError, match="model_token_mask has 1 entries for 2 completion tokens"):
        run_from_trajectory([1], [5, 6], [1])
    with pytest.raises(ValueError, match="logprobs has 1 entries"):
        run_from_trajectory([1], [5, 6], [1, 1], [0.0])

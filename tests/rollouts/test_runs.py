"""`trinity_trl/rollouts/runs.py`: a whole `Run` laid out as `TrainingRow`s (one row per chain of steps that extend
one another, or one per step), by hand-computed examples."""

from __future__ import annotations

import math

from trinity_trl.rollouts import Run, Step, TrainingRow

NAN = float("nan")


def two_turns(**run) -> Run:
    """Turn 0: prompt [1, 2] -> [3, 4]; turn 1 extends it with the observation [9]: prompt [1, 2, 3, 4, 9] -> [5, 6, 7]
    (7 is the EOS)."""
    steps = [
        Step([1, 2], [3, 4], [-0.1, -0.2], 0.0, "a"),
        Step([1, 2, 3, 4, 9], [5, 6, 7], [-0.3, -0.4, -0.5], 1.0, "b"),
    ]
    return Run(steps=steps, reward=1.0, **run)


def same(row: TrainingRow, expected: TrainingRow) -> bool:
    """Equal, NaN == NaN in the sampling log-probs."""
    logps = [(-1.0 if math.isnan(x) else x) for x in row.sampling_logps]
    want = [(-1.0 if math.isnan(x) else x) for x in expected.sampling_logps]
    return logps == want and {**vars(row), "sampling_logps": 0} == {**vars(expected), "sampling_logps": 0}


def test_a_prefix_preserving_run_is_one_row_with_each_turns_advantage():
    (row,) = two_turns().training_rows([0.5, -0.25], shared=True)
    expected = TrainingRow(
        prompt_ids=[1, 2],
        completion_ids=[3, 4, 9, 5, 6, 7],  # turn 0, the observation, turn 1
        segment_ids=[0, 0, -1, 1, 1, 1],
        advantages=[0.5, 0.5, 0.0, -0.25, -0.25, -0.25],
        sampling_logps=[-0.1, -0.2, NAN, -0.3, -0.4, -0.5],
        sample_count=2,
        step_width=3,
    )
    assert same(row, expected)


def test_one_row_per_step_without_shared_prefix_or_when_the_history_was_rewritten():
    for run, shared in ((two_turns(), False), (two_turns(prefix_preserving=False), True)):
        first, second = run.training_rows([0.5, -0.25], shared=shared)
        assert same(first, TrainingRow([1, 2], [3, 4], [0, 0], [0.5, 0.5], [-0.1, -0.2], 1, 2))
        assert same(second, TrainingRow([1, 2, 3, 4, 9], [5, 6, 7], [1] * 3, [-0.25] * 3, [-0.3, -0.4, -0.5], 1, 3))


def test_untrained_steps_keep_their_tokens_but_no_segment_or_advantage():
    # turn 0 unscored (None); with an EOS required (mask_truncated_completions), turn 0 does not end with 7 either
    (row,) = two_turns().training_rows([None, 2.0], shared=True)
    assert row.segment_ids == [-1, -1, -1, 1, 1, 1] and row.sample_count == 1
    (row,) = two_turns().training_rows([1.0, 2.0], shared=True, eos_token_ids={7})
    assert row.segment_ids == [-1, -1, -1, 1, 1, 1] and row.advantages == [0.0, 0.0, 0.0, 2.0, 2.0, 2.0]
    (row,) = two_turns().training_rows([1.0, 2.0], shared=True, eos_token_ids={4, 7})
    assert row.sample_count == 2


def test_an_agent_runs_segments_are_its_rows_and_a_run_without_calls_has_none():
    rows = two_turns(segments=[[0], [1]]).training_rows([0.5, -0.25], shared=True)
    assert [r.prompt_ids for r in rows] == [[1, 2], [1, 2, 3, 4, 9]]
    assert two_turns(segments=[]).training_rows([0.5, -0.25], shared=True) == []


def test_a_padding_row_trains_nothing():
    row = TrainingRow.padding(0)
    assert row.sample_count == 0 and row.segment_ids == [-1] and row.prompt_ids == row.completion_ids == [0]

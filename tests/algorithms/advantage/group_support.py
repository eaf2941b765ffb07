"""Helpers for the tests of group (experience-operator) advantage functions."""

from __future__ import annotations

import torch
from tolerance import approx

from trinity_trl.algorithms.advantage import ADVANTAGE_FN
from trinity_trl.algorithms.experience import Experience

from ..conftest import make_group_experiences

GROUP_TERMS = 4 * 4  # docs/algorithms/reference-values.md#group-advantage-values: groups of at most 4 runs of 4 tokens


def by_run(exps):
    return {(exp.eid.task, exp.eid.run): exp for exp in exps}


def assert_advantage(exp: Experience, expected: float) -> None:
    """``expected`` on unmasked tokens, exactly 0 on masked ones, returns == advantages."""
    mask = exp.action_mask.bool()
    assert exp.advantages.dtype == torch.float32
    for value in exp.advantages[mask].tolist():
        # a group statistic of at most 4 runs x 4 tokens in float32; z-scores |A| < 2 set the scale
        # (docs/algorithms/reference-values.md#group-advantage-values)
        assert value == approx(expected, terms=GROUP_TERMS, scale=2.0)
    assert torch.all(exp.advantages[~mask] == 0)
    assert torch.equal(exp.returns, exp.advantages)
    assert exp.returns is not exp.advantages


def assert_task(out, task: int, expected: list[float]) -> None:
    runs = by_run(out)
    for run, value in enumerate(expected):
        assert_advantage(runs[(task, run)], value)


def run_fn(key: str, exps=None, **kwargs):
    return ADVANTAGE_FN.get(key)(**kwargs)(make_group_experiences() if exps is None else exps)

"""DPO loss on interleaved pairs (docs/algorithms/policy-losses.md#dpo):
docs/algorithms/reference-values.md#policy-loss-values numbers, gradient, pairing, bad args."""

from __future__ import annotations

import pytest
import torch
from tolerance import approx, assert_close

from ..support import MEAN_EPSILON, _grad, assert_reference_values, build, small_data

REFERENCE = [
    # (key, overrides, loss, metrics)
    # docs/algorithms/reference-values.md#policy-loss-values has 5 rows: the reference sums the unpaired 5th (chosen)
    # row too
    ("dpo", {"allow_odd_rows": True}, 0.5406752228736877,
     {"chosen_reward": 0.7082431316375732, "rejected_reward": 0.3757950782775879, "accuracy_mean": 1.0}),
    ("dpo", {"allow_odd_rows": True, "beta": 0.2, "label_smoothing": 0.1}, 0.48146069049835205,
     {"chosen_reward": 1.4164862632751465, "rejected_reward": 0.7515901565551758}),
]  # fmt: skip


@pytest.mark.parametrize("key, overrides, loss, metrics", REFERENCE)
def test_reference_values(policy_data, key, overrides, loss, metrics):
    assert_reference_values(policy_data, key, overrides, loss, metrics)


def test_dpo_gradient():
    data = small_data()
    mask = data["action_mask"]
    beta = 0.3
    log_ratio = ((data["logprob"] - data["ref_logprob"]) * mask).sum(-1)
    h = log_ratio[0::2].sum() - log_ratio[1::2].sum()
    sign = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)[:, None]
    expected = -beta * torch.sigmoid(-beta * h) * sign * mask
    assert_close(_grad(build("dpo", beta=beta), data), expected, known_rtol=MEAN_EPSILON)


def test_dpo_single_pair_equals_textbook_dpo():
    data = small_data(batch=2)
    beta, ls = 0.2, 0.1
    loss, metrics = build("dpo", beta=beta, label_smoothing=ls)(**data)
    mask = data["action_mask"]
    rewards = beta * ((data["logprob"] - data["ref_logprob"]) * mask).sum(-1)
    margin = rewards[0] - rewards[1]
    expected = -(1 - ls) * torch.nn.functional.logsigmoid(margin) - ls * torch.nn.functional.logsigmoid(-margin)
    assert loss.item() == approx(expected.item(), dtype=torch.float64, terms=mask.shape[1], scale=1.0)  # row sums
    assert metrics["chosen_reward"] == approx(rewards[0].item(), dtype=torch.float64, terms=mask.shape[1], scale=1.0)
    assert metrics["accuracy_mean"] == float(margin > 0)


@pytest.mark.parametrize("rows", [0, 1, 3, 5])
def test_dpo_rejects_unpaired_rows(rows):
    data = small_data(batch=max(rows, 1))
    data = {k: v[:rows] for k, v in data.items()}
    with pytest.raises(ValueError, match=f"even number .* of rows.*got {rows}"):
        build("dpo")(**data)
    if rows >= 3:  # the reference behaviour, on request
        build("dpo", allow_odd_rows=True)(**data)


BAD_ARGS = [
    ("dpo", {"beta": 0.0}, "beta must be > 0, got 0.0"),
    ("dpo", {"label_smoothing": 0.5}, r"label_smoothing must be in \[0, 0.5\), got 0.5"),
    ("dpo", {"label_smoothing": -0.1}, "label_smoothing must be in"),
]


@pytest.mark.parametrize("key, overrides, message", BAD_ARGS)
def test_bad_arguments(key, overrides, message):
    with pytest.raises(ValueError, match=message):
        build(key, **overrides)

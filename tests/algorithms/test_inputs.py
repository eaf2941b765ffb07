"""Input names (``inputs.py``, docs/algorithms/index.md#notation, docs/algorithms/index.md#call-convention): one input
under several names resolves when the values are equal; only different values are an error. The same rule reads
advantage batches (``batch_get``)."""

from __future__ import annotations

import math

import pytest
import torch

from trinity_trl.algorithms.advantage import ADVANTAGE_FN
from trinity_trl.algorithms.advantage.advantage_fn import batch_get
from trinity_trl.algorithms.inputs import resolve_inputs, same_value

from .conftest import make_batch
from .support import build


def test_same_object_and_equal_tensors_resolve():
    x = torch.tensor([[0.1, math.nan], [0.3, 0.4]])
    for other in (x, x.clone()):  # NaN equals NaN here
        inputs = resolve_inputs({"old_logprob": x, "old_log_probs": other}, ("old_logprob",))
        assert inputs["old_logprob"] is x  # the first name in alias order


def test_equal_masks_of_different_dtypes_resolve():
    mask = torch.tensor([[True, False, True]])
    inputs = resolve_inputs({"completion_mask": mask.float(), "response_mask": mask}, ("action_mask",))
    assert inputs["action_mask"].dtype == torch.bool  # response_mask comes first in alias order


@pytest.mark.parametrize(
    "other",
    [
        torch.tensor([[0.1, 0.2], [0.3, 0.5]]),  # one entry differs
        torch.tensor([[0.1, math.nan], [0.3, 0.4]]),  # NaN against a number
        torch.tensor([0.1, 0.2, 0.3, 0.4]),  # same entries, another shape
    ],
)
def test_different_values_are_an_error(other):
    x = torch.tensor([[0.1, 0.2], [0.3, 0.4]])
    with pytest.raises(ValueError, match="Ambiguous input 'old_logprob': old_logprob and old_per_token_logps"):
        resolve_inputs({"old_logprob": x, "old_per_token_logps": other}, ("old_logprob",))


def test_same_value_on_plain_values():
    assert same_value([3, 3], [3, 3]) and same_value(torch.tensor([3, 3]), [3, 3])
    assert not same_value([3, 3], [3, 4]) and not same_value(torch.tensor([3, 3]), "x")


def test_a_loss_called_with_a_verl_batch_that_also_has_trinity_names(policy_data):
    """The case of docs/algorithms/index.md#notation: a verl batch that also holds the Trinity names, as copies."""
    d = policy_data
    one_name = build("ppo")(**d)
    both = build("ppo")(
        **d,
        old_log_probs=d["old_logprob"].clone(),
        response_mask=d["action_mask"].clone(),
        log_prob=d["logprob"].clone(),
    )
    assert torch.equal(one_name[0], both[0]) and one_name[1] == both[1]
    with pytest.raises(ValueError, match="Ambiguous input 'old_logprob'"):
        build("ppo")(**d, old_log_probs=d["old_logprob"] + 1)


def test_batch_get_follows_the_same_rule():
    batch = make_batch()
    batch["completion_mask"] = batch["response_mask"].clone()
    assert batch_get(batch, "response_mask") is batch["response_mask"]
    out, _ = ADVANTAGE_FN.get("rloo")()(batch)  # runs with both names present
    assert out["advantages"].shape == (6, 5)
    batch["completion_mask"] = ~batch["response_mask"]
    with pytest.raises(ValueError, match="Ambiguous input 'action_mask': response_mask and completion_mask"):
        batch_get(batch, "response_mask")


def test_rewards_win_over_scores_which_are_not_an_alias():
    batch = make_batch()
    batch["token_level_scores"] = batch["token_level_rewards"] + 1.0  # rewards = scores − KL penalty
    assert batch_get(batch, "token_level_rewards") is batch["token_level_rewards"]
    del batch["token_level_rewards"]
    assert batch_get(batch, "token_level_rewards") is batch["token_level_scores"]

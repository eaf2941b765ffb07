"""Input builders for the reference values of spec §14 (built exactly as the spec says)."""

from __future__ import annotations

import pytest
import torch


def make_policy_data() -> dict[str, torch.Tensor]:
    """Spec §14.1: seed 42, shape (5, 20), drawn in the order ℓ, ℓo, ℓr, m, A, e."""
    torch.manual_seed(42)
    shape = (5, 20)
    logprob = 2 * torch.rand(shape) - 1
    old_logprob = 2 * torch.rand(shape) - 1
    ref_logprob = 2 * torch.rand(shape) - 1
    action_mask = torch.rand(shape) > 0.5
    advantages = 2 * torch.rand(shape) - 1
    expert_mask = torch.rand(5) > 0.5
    return {
        "logprob": logprob,
        "old_logprob": old_logprob,
        "ref_logprob": ref_logprob,
        "action_mask": action_mask,
        "advantages": advantages,
        "expert_mask": expert_mask,
    }


def make_kl_data() -> dict[str, torch.Tensor]:
    """Spec §14.2: seed 42, shape (4, 10), drawn in the order ℓ, ℓr, ℓo, m, then H."""
    torch.manual_seed(42)
    shape = (4, 10)
    logprob = 2 * torch.rand(shape) - 1
    ref_logprob = 2 * torch.rand(shape) - 1
    old_logprob = 2 * torch.rand(shape) - 1
    response_mask = torch.rand(shape) > 0.5
    entropy = torch.rand(shape)
    return {
        "logprob": logprob,
        "ref_logprob": ref_logprob,
        "old_logprob": old_logprob,
        "response_mask": response_mask,
        "entropy": entropy,
    }


@pytest.fixture
def policy_data() -> dict[str, torch.Tensor]:
    data = make_policy_data()
    assert data["action_mask"].sum(-1).tolist() == [12, 6, 9, 10, 11]
    assert data["expert_mask"].tolist() == [False, False, True, True, True]
    return data


@pytest.fixture
def kl_data() -> dict[str, torch.Tensor]:
    data = make_kl_data()
    assert data["response_mask"].sum(-1).tolist() == [2, 4, 6, 5]
    return data

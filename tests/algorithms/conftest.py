"""Input builders for the reference values of docs/algorithms/reference-values.md (built exactly as it says), and
fixtures."""

from __future__ import annotations

import pytest
import torch

from trinity_trl.algorithms.advantage import scalar_rewards_to_token_level
from trinity_trl.algorithms.experience import EID, Experience


def make_policy_data() -> dict[str, torch.Tensor]:
    """docs/algorithms/reference-values.md#policy-loss-values: seed 42, shape (5, 20), drawn in the order ℓ, ℓo, ℓr, m,
    A, e."""
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
    """docs/algorithms/reference-values.md#kl-entropy-values: seed 42, shape (4, 10), drawn in the order ℓ, ℓr, ℓo, m,
    then H."""
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


GROUP_REWARDS = {0: [1.0, 0.0, 0.0, 1.0], 1: [0.5, 0.2, 0.9, 0.1], 2: [0.3, 0.3, 0.3, 0.3], 3: [0.7]}


def make_group_experiences(tasks=(0, 1, 2, 3)) -> list[Experience]:
    """docs/algorithms/reference-values.md#group-advantage-values: batch 0, 6 tokens with prompt_length 2, mask
    [1,1,1,1] (even run) / [1,1,1,0] (odd run), logprobs of run i constant −0.1·(i+1)."""
    exps = []
    for task in tasks:
        for run, reward in enumerate(GROUP_REWARDS[task]):
            mask = torch.tensor([1, 1, 1, 1] if run % 2 == 0 else [1, 1, 1, 0], dtype=torch.bool)
            exps.append(
                Experience(
                    eid=EID(batch=0, task=task, run=run),
                    tokens=torch.arange(6),
                    prompt_length=2,
                    reward=reward,
                    logprobs=torch.full((4,), -0.1 * (run + 1)),
                    action_mask=mask,
                )
            )
    return exps


def make_step_experiences(non_last_reward: float = 9.0) -> list[Experience]:
    """docs/algorithms/reference-values.md#group-advantage-values step-wise data: task 0 runs of 1/2/3 steps (last
    rewards 1.0, 0.0, 0.5), task 1 two runs of 2 steps (0.2 each), task 2 one run of 1 step (0.9); mask [1,1,0]."""
    runs = {0: [(1, 1.0), (2, 0.0), (3, 0.5)], 1: [(2, 0.2), (2, 0.2)], 2: [(1, 0.9)]}
    exps = []
    for task, task_runs in runs.items():
        for run, (steps, last_reward) in enumerate(task_runs):
            for step in range(steps):
                exps.append(
                    Experience(
                        eid=EID(batch=0, task=task, run=run, step=step),
                        tokens=torch.arange(5),
                        prompt_length=2,
                        reward=last_reward if step == steps - 1 else non_last_reward,
                        action_mask=torch.tensor([1, 1, 0], dtype=torch.bool),
                    )
                )
    return exps


MASK_ROWS = [[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]


ROW_REWARDS = [1.0, 0.0, 0.5, 1.0, 0.2, 0.7]


UID = ["a", "a", "a", "b", "b", "c"]


def make_batch(uid=None) -> dict:
    """docs/algorithms/reference-values.md#batch-advantage-values: B=6, T=5, each reward at the last valid token, uid
    [a, a, a, b, b, c]."""
    mask = torch.tensor(MASK_ROWS, dtype=torch.bool)
    rewards = scalar_rewards_to_token_level(torch.tensor(ROW_REWARDS), mask)
    return {"token_level_rewards": rewards, "response_mask": mask, "uid": list(UID) if uid is None else uid}

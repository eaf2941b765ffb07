"""Behaviour every batch (trainer-side) advantage function shares (docs/algorithms/advantages.md#two-kinds,
docs/algorithms/advantages.md#batch-functions), and the reference values of the grouped ones (``rloo``, ``grpo_verl``,
``opmd_verl``, ``asymre_verl``; docs/algorithms/reference-values.md#batch-advantage-values), which share the group
statistics of ``advantage/grpo.py``."""

from __future__ import annotations

import math

import pytest
import torch
from tolerance import assert_close

from trinity_trl.algorithms.advantage import ADVANTAGE_FN

from ..conftest import UID, make_batch
from .batch_support import assert_rows, distill_batch, run_fn

ROW_VALUES = {
    "rloo": [0.75, -0.75, 0.0, 0.8, -0.8, 0.7],
    "grpo_verl": [0.999998, -0.999998, 0.0, 0.7071055, -0.7071055, 0.6999993],
    "opmd_verl": [0.5, -0.5, 0.0, 0.4, -0.4, 0.7],
    "asymre_verl": [0.6, -0.4, 0.1, 0.5, -0.3, 0.7],
}


@pytest.mark.parametrize("key", list(ROW_VALUES))
def test_grouped_reference_values(key):
    batch, metrics = run_fn(key)
    assert metrics == {}
    assert batch["advantages"].dtype == torch.float32
    assert_rows(batch["advantages"], ROW_VALUES[key])
    assert torch.equal(batch["returns"], batch["advantages"]) and batch["returns"] is not batch["advantages"]


@pytest.mark.parametrize("key", list(ROW_VALUES))
@pytest.mark.parametrize(
    "uid",
    [
        [10, 10, 10, 20, 20, 30],
        torch.tensor([3, 3, 3, 1, 1, 2]),
        ["x/0", "x/0", "x/0", "x/1", "x/1", "x/2"],
    ],
)
def test_uid_kinds(key, uid):
    batch, _ = run_fn(key, make_batch(uid=uid))
    assert_rows(batch["advantages"], ROW_VALUES[key])


@pytest.mark.parametrize("key", list(ROW_VALUES))
def test_nan_in_padded_reward_poisons_its_group(key):
    """Documented reference behaviour: the row score sums the full width (a reward may sit under a
    zero of response_mask), so a NaN there reaches its whole group, and only its group."""
    batch = make_batch()
    batch["token_level_rewards"][3, 4] = float("nan")  # row 3 (group b) is padded from t = 2
    out, _ = run_fn(key, batch)
    mask = batch["response_mask"]
    for b in range(6):
        valid = out["advantages"][b][mask[b]]
        assert torch.isnan(valid).all() if UID[b] == "b" else torch.isfinite(valid).all()
    assert_rows(out["advantages"][:3], ROW_VALUES[key][:3])


@pytest.mark.parametrize("key", list(ROW_VALUES))
def test_row_score_counts_rewards_under_masked_tokens(key):
    """A reward on a masked (e.g. tool) token still counts: the score sums the full width."""
    batch = make_batch()
    rewards = batch["token_level_rewards"]
    rewards[0, 3], rewards[0, 4] = 0.0, 1.0  # row 0's reward moved onto its masked last position
    out, _ = run_fn(key, batch)
    assert_rows(out["advantages"], ROW_VALUES[key])


def per_group_reference(scores: torch.Tensor, uid: list[int], key: str) -> torch.Tensor:
    """Per-group Python loop over torch reductions, as the reference does (test-only)."""
    out = torch.empty_like(scores)
    for group in dict.fromkeys(uid):
        rows = torch.tensor([i for i, u in enumerate(uid) if u == group])
        s = scores[rows]
        n = len(rows)
        if key == "rloo":
            out[rows] = s if n == 1 else s * n / (n - 1) - s.mean() * n / (n - 1)
        elif key == "grpo_verl":
            mean, std = (torch.tensor(0.0), torch.tensor(1.0)) if n == 1 else (s.mean(), s.std())
            out[rows] = (s - mean) / (std + 1e-6)
        elif key == "opmd_verl":  # logavgexp, tau = 0.3
            b = torch.tensor(0.0) if n == 1 else 0.3 * (torch.logsumexp(s / 0.3, -1) - math.log(n))
            out[rows] = s - b
        else:
            out[rows] = s - (torch.tensor(0.0) if n == 1 else s.mean() - 0.1)
    return out


@pytest.mark.parametrize("key", ["rloo", "grpo_verl", "opmd_verl", "asymre_verl"])
def test_grouped_functions_on_many_shuffled_rows(key):
    g = torch.Generator().manual_seed(11)
    rows, width = 3000, 4
    uid = torch.randint(0, 700, (rows,), generator=g).tolist()  # random group sizes, singletons included
    rewards = torch.randn(rows, width, generator=g)
    mask = torch.ones(rows, width, dtype=torch.bool)
    kwargs = {"opmd_baseline": "logavgexp", "tau": 0.3} if key == "opmd_verl" else {}
    out, _ = ADVANTAGE_FN.get(key)(**kwargs)({"token_level_rewards": rewards, "response_mask": mask, "uid": uid})
    expected = per_group_reference(rewards.sum(-1), uid, key)
    # a group baseline sums the row rewards (width 4 each) of its group's members, in float32 against the reference
    largest_group = max(uid.count(u) for u in set(uid))
    assert_close(out["advantages"][:, 0], expected, terms=width * largest_group)
    assert 1 in {uid.count(u) for u in set(uid)}


@pytest.mark.parametrize("key", ["reinforceplusplus", "ppo"])
@pytest.mark.parametrize("valid", [0, 1])
def test_whitening_needs_two_valid_tokens(key, valid):
    mask = torch.zeros(2, 3, dtype=torch.bool)
    mask.view(-1)[:valid] = True
    batch = {"token_level_rewards": torch.ones(2, 3), "response_mask": mask, "values": torch.zeros(2, 3)}
    with pytest.raises(ValueError, match="masked_var"):
        ADVANTAGE_FN.get(key)()(batch)


@pytest.mark.parametrize(
    "key, drop, match",
    [
        ("rloo", "uid", "uid"),
        ("grpo_verl", "token_level_rewards", "token_level_rewards"),
        ("opmd_verl", "response_mask", "action_mask"),
        ("ppo", "values", "values"),
        ("remax", "reward_baselines", "reward_baselines"),
        ("on_policy_distill", "teacher_logprobs", "teacher_logprobs"),
        ("on_policy_distill", "old_log_probs", "old_logprob"),
    ],
)
def test_missing_key(key, drop, match):
    batch = {**make_batch(), **distill_batch(), "values": torch.zeros(6, 5), "reward_baselines": torch.zeros(6)}
    del batch[drop]
    with pytest.raises(ValueError, match=match):
        ADVANTAGE_FN.get(key)()(batch)


def test_aliases_token_level_scores_and_completion_mask():
    batch = make_batch()
    aliased = {
        "token_level_scores": batch["token_level_rewards"],
        "completion_mask": batch["response_mask"],
        "uid": UID,
    }
    out, _ = run_fn("grpo_verl", aliased)
    assert_rows(out["advantages"], ROW_VALUES["grpo_verl"])


@pytest.mark.parametrize("key", ["rloo", "reinforceplusplus"])
def test_shape_mismatch(key):
    batch = make_batch()
    batch["response_mask"] = batch["response_mask"][:, :4]
    with pytest.raises(ValueError, match="must"):
        run_fn(key, batch)


def test_uid_length_mismatch():
    with pytest.raises(ValueError, match="uid"):
        run_fn("rloo", make_batch(uid=UID[:5]))


@pytest.mark.parametrize(
    "key, kwargs, match",
    [
        ("reinforceplusplus", {"gamma": 1.5}, "gamma"),
        ("reinforceplusplus", {"gamma": -0.1}, "gamma"),
        ("reinforceplusplus", {"gamma": float("nan")}, "gamma"),
        ("ppo", {"lam": 1.01}, "lam"),
        ("ppo", {"gamma": "1"}, "gamma"),
        ("grpo_verl", {"epsilon": 0.0}, "epsilon"),
        ("opmd_verl", {"opmd_baseline": "logsumexp"}, "'mean', 'logavgexp'"),
        ("opmd_verl", {"tau": -1.0}, "tau"),
        ("asymre_verl", {"baseline_shift": float("nan")}, "baseline_shift"),
        ("on_policy_distill", {"kl_coef": float("inf")}, "kl_coef"),
    ],
)
def test_bad_args(key, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ADVANTAGE_FN.get(key)(**kwargs)


def test_default_args_match_spec():
    expected = {
        "ppo": {"gamma": 1.0, "lam": 1.0},
        "reinforceplusplus": {"gamma": 1.0},
        "rloo": {},
        "remax": {},
        "grpo_verl": {"epsilon": 1e-6},
        "opmd_verl": {"opmd_baseline": "mean", "tau": 1.0},
        "asymre_verl": {"baseline_shift": -0.1},
        "on_policy_distill": {"kl_coef": 1.0},
    }
    for key, args in expected.items():
        assert ADVANTAGE_FN.get(key).default_args() == args
        assert ADVANTAGE_FN.get(key).compute_in_trainer() is True

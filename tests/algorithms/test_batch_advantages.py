"""Batch (trainer-side) advantage functions: spec §12.9, reference values §14.4."""

from __future__ import annotations

import math

import pytest
import torch

from trinity_trl.algorithms.advantage import ADVANTAGE_FN, scalar_rewards_to_token_level
from trinity_trl.algorithms.advantage.reinforceplusplus import discounted_reverse_cumsum

MASK_ROWS = [[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
ROW_REWARDS = [1.0, 0.0, 0.5, 1.0, 0.2, 0.7]
UID = ["a", "a", "a", "b", "b", "c"]


def make_batch(uid=None) -> dict:
    """Spec §14.4: B=6, T=5, each reward at the last valid token, uid [a, a, a, b, b, c]."""
    mask = torch.tensor(MASK_ROWS, dtype=torch.bool)
    rewards = scalar_rewards_to_token_level(torch.tensor(ROW_REWARDS), mask)
    return {"token_level_rewards": rewards, "response_mask": mask, "uid": list(UID) if uid is None else uid}


def run_fn(key: str, batch=None, **kwargs):
    return ADVANTAGE_FN.get(key)(**kwargs)(make_batch() if batch is None else batch)


def assert_rows(advantages: torch.Tensor, per_row: list[float], masked_zero: bool = True) -> None:
    mask = torch.tensor(MASK_ROWS, dtype=torch.bool)
    for b, value in enumerate(per_row):
        for v in advantages[b][mask[b]].tolist():
            assert v == pytest.approx(value, abs=1e-6), (b, v, value)
        if masked_zero:
            assert torch.all(advantages[b][~mask[b]] == 0)


def naive_discounted_sum(x: torch.Tensor, discount: float) -> torch.Tensor:
    """Right-to-left Python loop (test-only reference), float64."""
    x = x.to(torch.float64)
    out = torch.zeros_like(x)
    running = torch.zeros_like(x[..., 0])
    for t in reversed(range(x.shape[-1])):
        running = x[..., t] + discount * running
        out[..., t] = running
    return out


# --------------------------------------------------------------------------------------------- reference values

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
@pytest.mark.parametrize("uid", [
    [10, 10, 10, 20, 20, 30],
    torch.tensor([3, 3, 3, 1, 1, 2]),
    ["x/0", "x/0", "x/0", "x/1", "x/1", "x/2"],
])
def test_uid_kinds(key, uid):
    batch, _ = run_fn(key, make_batch(uid=uid))
    assert_rows(batch["advantages"], ROW_VALUES[key])


def test_reinforceplusplus_gamma_one():
    batch, metrics = run_fn("reinforceplusplus")
    assert metrics == {}
    assert_rows(batch["advantages"], [1.2574311, -1.5779527, -0.1602608, 1.2574311, -1.0108759, 0.406816])
    # returns = G, unmasked: γ = 1 puts the row reward on every position up to it
    expected_returns = naive_discounted_sum(make_batch()["token_level_rewards"], 1.0).to(torch.float32)
    assert torch.allclose(batch["returns"], expected_returns, atol=1e-6)


def test_reinforceplusplus_gamma_09_row0():
    batch, _ = run_fn("reinforceplusplus", gamma=0.9)
    expected = [0.7903844, 1.0431250, 1.3239480, 1.6359736, 0.0]
    assert batch["advantages"][0].tolist() == pytest.approx(expected, abs=1e-6)
    assert batch["returns"][0].tolist() == pytest.approx([0.729, 0.81, 0.9, 1.0, 0.0], abs=1e-6)


def test_remax():
    batch = make_batch()
    batch["reward_baselines"] = torch.tensor([0.5, 0.5, 0.5, 0.1, 0.1, 0.0])
    batch, metrics = run_fn("remax", batch)
    assert metrics == {}
    assert_rows(batch["advantages"], [0.5, -0.5, 0.0, 0.9, 0.1, 0.7])
    assert_rows(batch["returns"], ROW_REWARDS)


def gae_batch() -> dict:
    batch = make_batch()
    batch["values"] = torch.linspace(-0.5, 0.5, 30).reshape(6, 5)
    return batch


def test_gae_row0():
    batch, metrics = run_fn("ppo", gae_batch())
    assert metrics == {}
    expected = [1.8758316, 1.8075440, 1.7392564, 1.6709689, -0.3776604]
    # the masked last position is whitened too, not zeroed
    assert batch["advantages"][0].tolist() == pytest.approx(expected, abs=1e-6)


def naive_gae(rewards, values, gamma, lam):
    """verl's right-to-left GAE loop (test-only reference), float64."""
    r, v = rewards.double(), values.double()
    width = r.shape[1]
    last = torch.zeros(r.shape[0], dtype=torch.float64)
    out = torch.zeros_like(r)
    for t in reversed(range(width)):
        next_v = v[:, t + 1] if t < width - 1 else 0.0
        delta = r[:, t] + gamma * next_v - v[:, t]
        last = delta + gamma * lam * last
        out[:, t] = last
    return out


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.0, 0.7)])
def test_gae_matches_loop_reference(gamma, lam):
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(7, 13, generator=g)
    values = torch.randn(7, 13, generator=g)
    mask = torch.rand(7, 13, generator=g) > 0.3
    batch, _ = ADVANTAGE_FN.get("ppo")(gamma=gamma, lam=lam)(
        {"token_level_rewards": rewards, "values": values, "response_mask": mask})
    adv = naive_gae(rewards, values, gamma, lam)
    assert torch.allclose(batch["returns"].double(), adv + values.double(), atol=1e-5)
    m = mask.double()
    mean = (adv * m).sum() / m.sum()
    var = (((adv - mean) ** 2) * m).sum() / (m.sum() - 1)
    assert torch.allclose(batch["advantages"].double(), (adv - mean) / torch.sqrt(var + 1e-8), atol=1e-5)


# --------------------------------------------------------------------------------------------- the scan


@pytest.mark.parametrize("width", [1, 2, 3, 5, 8, 13, 64, 100])
@pytest.mark.parametrize("discount", [0.0, 0.5, 0.9, 0.99, 1.0])
def test_discounted_reverse_cumsum_matches_loop(width, discount):
    g = torch.Generator().manual_seed(width)
    x = torch.randn(4, width, generator=g)
    result = discounted_reverse_cumsum(x, discount)
    assert result.shape == x.shape and result.dtype == x.dtype
    assert torch.allclose(result.double(), naive_discounted_sum(x, discount), atol=1e-5)
    assert torch.equal(x, torch.randn(4, width, generator=torch.Generator().manual_seed(width)))  # input untouched


def test_discounted_reverse_cumsum_1d_and_float64():
    x = torch.randn(37, dtype=torch.float64)
    assert torch.allclose(discounted_reverse_cumsum(x, 0.8), naive_discounted_sum(x, 0.8), atol=1e-12)


# --------------------------------------------------------------------------------------------- on-policy distillation


def distill_batch(old_key="old_log_probs") -> dict:
    g = torch.Generator().manual_seed(3)
    mask = torch.tensor(MASK_ROWS, dtype=torch.bool)
    return {"teacher_logprobs": -torch.rand(6, 5, generator=g), old_key: -torch.rand(6, 5, generator=g),
            "response_mask": mask}


@pytest.mark.parametrize("old_key", ["old_log_probs", "old_logprob", "old_per_token_logps"])
def test_on_policy_distill(old_key):
    batch = distill_batch(old_key)
    teacher, old, mask = batch["teacher_logprobs"], batch[old_key], batch["response_mask"].float()
    out, metrics = run_fn("on_policy_distill", batch, kl_coef=0.5)
    expected = 0.5 * (teacher - old) * mask
    assert torch.allclose(out["advantages"], expected, atol=1e-7)
    assert torch.equal(out["returns"], out["advantages"]) and out["returns"] is not out["advantages"]
    k = ((old - teacher) * mask).sum(-1)
    assert metrics["kl/mean"] == pytest.approx(k.mean().item(), abs=1e-6)
    assert metrics["kl/std"] == pytest.approx(k.std().item(), abs=1e-6)
    assert metrics["advantages/mean"] == pytest.approx(expected.sum(-1).mean().item(), abs=1e-6)
    assert set(metrics) == {"kl/mean", "kl/std", "advantages/mean"}


def test_on_policy_distill_single_row_std_is_zero():
    batch = {key: value[:1] for key, value in distill_batch().items()}
    _, metrics = run_fn("on_policy_distill", batch)
    assert metrics["kl/std"] == 0.0


# --------------------------------------------------------------------------------------------- NaN in padding


def nan_padded(batch: dict, key: str) -> dict:
    mask = batch["response_mask"]
    batch[key] = torch.where(mask, batch[key], torch.full_like(batch[key], float("nan")))
    return batch


def test_nan_padding_does_not_leak_into_remax():
    batch = nan_padded(make_batch(), "token_level_rewards")
    batch["reward_baselines"] = torch.tensor([0.5, 0.5, 0.5, 0.1, 0.1, 0.0])
    out, _ = run_fn("remax", batch)
    assert_rows(out["advantages"], [0.5, -0.5, 0.0, 0.9, 0.1, 0.7])
    assert torch.isfinite(out["advantages"]).all() and torch.isfinite(out["returns"]).all()


@pytest.mark.parametrize("key", ["teacher_logprobs", "old_log_probs"])
def test_nan_padding_does_not_leak_into_on_policy_distill(key):
    clean, clean_metrics = run_fn("on_policy_distill", distill_batch())
    dirty, dirty_metrics = run_fn("on_policy_distill", nan_padded(distill_batch(), key))
    assert torch.equal(dirty["advantages"], clean["advantages"])
    assert dirty_metrics == clean_metrics


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


def test_nan_in_padded_reward_reaches_reinforceplusplus():
    """Documented reference behaviour: no reset at padding, then a global whitening."""
    batch = make_batch()
    batch["token_level_rewards"][0, 4] = float("nan")
    out, _ = run_fn("reinforceplusplus", batch)
    assert torch.isnan(out["advantages"][batch["response_mask"]]).all()


def test_nan_in_padded_value_reaches_gae():
    """Documented reference behaviour: V_{t+1} of the last valid token is a padded value."""
    batch = gae_batch()
    batch["values"][3, 2] = float("nan")  # the position right after row 3's last valid token
    out, _ = run_fn("ppo", batch)
    assert torch.isnan(out["returns"][3, :3]).all()
    assert torch.isnan(out["advantages"]).all()


@pytest.mark.parametrize("lam", [1.0, 0.0])
def test_gae_nan_anywhere_in_padding_flows_left_like_the_reference_loop(lam):
    """Even with γλ = 0 the reference loop computes 0·NaN = NaN, so a NaN deep in the padding
    still reaches every earlier position of its row; the scan reproduces that exactly."""
    batch = gae_batch()
    batch["values"][3, 4] = float("nan")
    out, _ = run_fn("ppo", batch, lam=lam)
    reference = naive_gae(batch["token_level_rewards"], batch["values"], 1.0, lam) + batch["values"].double()
    assert torch.equal(torch.isnan(out["returns"]), torch.isnan(reference))
    assert torch.isnan(out["returns"][3]).all() and torch.isfinite(out["returns"][:3]).all()


# --------------------------------------------------------------------------------------------- errors and args


@pytest.mark.parametrize("key", ["reinforceplusplus", "ppo"])
@pytest.mark.parametrize("valid", [0, 1])
def test_whitening_needs_two_valid_tokens(key, valid):
    mask = torch.zeros(2, 3, dtype=torch.bool)
    mask.view(-1)[:valid] = True
    batch = {"token_level_rewards": torch.ones(2, 3), "response_mask": mask, "values": torch.zeros(2, 3)}
    with pytest.raises(ValueError, match="masked_var"):
        ADVANTAGE_FN.get(key)()(batch)


@pytest.mark.parametrize("key, drop, match", [
    ("rloo", "uid", "uid"),
    ("grpo_verl", "token_level_rewards", "token_level_rewards"),
    ("opmd_verl", "response_mask", "action_mask"),
    ("ppo", "values", "values"),
    ("remax", "reward_baselines", "reward_baselines"),
    ("on_policy_distill", "teacher_logprobs", "teacher_logprobs"),
    ("on_policy_distill", "old_log_probs", "old_logprob"),
])
def test_missing_key(key, drop, match):
    batch = {**make_batch(), **distill_batch(), "values": torch.zeros(6, 5), "reward_baselines": torch.zeros(6)}
    del batch[drop]
    with pytest.raises(ValueError, match=match):
        ADVANTAGE_FN.get(key)()(batch)


def test_aliases_token_level_scores_and_completion_mask():
    batch = make_batch()
    aliased = {"token_level_scores": batch["token_level_rewards"], "completion_mask": batch["response_mask"],
               "uid": UID}
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


@pytest.mark.parametrize("key, kwargs, match", [
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
])
def test_bad_args(key, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ADVANTAGE_FN.get(key)(**kwargs)


def test_default_args_match_spec():
    expected = {"ppo": {"gamma": 1.0, "lam": 1.0}, "reinforceplusplus": {"gamma": 1.0}, "rloo": {}, "remax": {},
                "grpo_verl": {"epsilon": 1e-6}, "opmd_verl": {"opmd_baseline": "mean", "tau": 1.0},
                "asymre_verl": {"baseline_shift": -0.1}, "on_policy_distill": {"kl_coef": 1.0}}
    for key, args in expected.items():
        assert ADVANTAGE_FN.get(key).default_args() == args
        assert ADVANTAGE_FN.get(key).compute_in_trainer() is True


# --------------------------------------------------------------------------------------------- vectorised groups at scale


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
    assert torch.allclose(out["advantages"][:, 0], expected, atol=1e-5)
    assert 1 in {uid.count(u) for u in set(uid)}

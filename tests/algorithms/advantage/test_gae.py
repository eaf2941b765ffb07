"""PPO's GAE (docs/algorithms/advantages.md#batch-functions, reference values
docs/algorithms/reference-values.md#batch-advantage-values)."""

from __future__ import annotations

import pytest
import torch
from tolerance import approx, assert_close

from trinity_trl.algorithms.advantage import ADVANTAGE_FN

from ..conftest import make_batch
from .batch_support import BATCH_TERMS, run_fn


def gae_batch() -> dict:
    batch = make_batch()
    batch["values"] = torch.linspace(-0.5, 0.5, 30).reshape(6, 5)
    return batch


def test_gae_row0():
    batch, metrics = run_fn("ppo", gae_batch())
    assert metrics == {}
    expected = [1.8758316, 1.8075440, 1.7392564, 1.6709689, -0.3776604]
    # the masked last position is whitened too, not zeroed
    assert batch["advantages"][0].tolist() == approx(expected, terms=BATCH_TERMS, scale=2.0)


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
        {"token_level_rewards": rewards, "values": values, "response_mask": mask}
    )
    adv = naive_gae(rewards, values, gamma, lam)
    # float32 against a float64 loop: GAE's recursion over 13 tokens, then whitening over the 7 x 13 batch
    assert_close(batch["returns"].double(), adv + values.double(), terms=13, dtype=torch.float32)
    m = mask.double()
    mean = (adv * m).sum() / m.sum()
    var = (((adv - mean) ** 2) * m).sum() / (m.sum() - 1)
    assert_close(batch["advantages"].double(), (adv - mean) / torch.sqrt(var + 1e-8), terms=7 * 13, dtype=torch.float32)


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

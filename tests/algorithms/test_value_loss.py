"""Clipped value loss of the PPO critic (docs/algorithms/entropy.md#critic-loss).

docs/algorithms/entropy.md#critic-loss gives the formula but no reference numbers; the values below are worked out by
hand:

    V     = [[1.0, 2.0, 0.0], [0.5, -1.0, 3.0]]     V_old = [[0.0, 2.5, 0.0], [0.5, 0.0, 0.0]]
    R     = [[2.0, 2.0, 1.0], [0.0, -2.0, 9.0]]     m     = [[1, 1, 1], [1, 1, 0]],   c = 0.2

    clamp(V, V_old ± c) = [[0.2, 2.3, 0.0], [0.5, -0.2, ·]]
    (V − R)²            = [[1.0, 0.0, 1.0], [0.25, 1.0, ·]]
    (V_clip − R)²       = [[3.24, 0.09, 1.0], [0.25, 3.24, ·]]
    max                 = [[3.24, 0.09, 1.0], [0.25, 3.24, ·]]   (row sums 4.33, 3.49; total 7.82 over 5 tokens)
"""

from __future__ import annotations

import math

import pytest
import torch
from tolerance import approx, assert_close

from trinity_trl.algorithms.value_loss import clipped_value_loss

V = [[1.0, 2.0, 0.0], [0.5, -1.0, 3.0]]
V_OLD = [[0.0, 2.5, 0.0], [0.5, 0.0, 0.0]]
R = [[2.0, 2.0, 1.0], [0.0, -2.0, 9.0]]
MASK = [[1, 1, 1], [1, 1, 0]]


def tensors(values=V, old=V_OLD, returns=R, mask=MASK):
    v = torch.tensor(values, dtype=torch.float32, requires_grad=True)
    return v, torch.tensor(old), torch.tensor(returns), torch.tensor(mask, dtype=torch.bool)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 0.5 * 7.82 / 5),
        ("seq-mean-token-sum", 0.5 * (4.33 + 3.49) / 2),
        ("seq-mean-token-mean", 0.5 * (4.33 / 3 + 3.49 / 2) / 2),
        ("seq-mean-token-sum-norm", 0.5 * 7.82 / 3),
    ],
)
def test_hand_computed_loss(mode, expected):
    # float32 sums over the (2, 3) batch's 6 values against exact hand values (tests/tolerance.py)
    v, old, ret, mask = tensors()
    loss, metrics = clipped_value_loss(v, old, ret, mask, cliprange_value=0.2, loss_agg_mode=mode)
    assert loss.item() == approx(expected, terms=6)
    assert metrics["vf_loss"].item() == approx(expected, terms=6)
    # clipped strictly above unclipped at (0,0), (0,1), (1,1): 3 of the 5 valid tokens; the tie at (0,2) does not count
    assert metrics["vf_clipfrac"].item() == approx(0.6, terms=6)
    assert metrics["vpred_mean"].item() == approx((1.0 + 2.0 + 0.0 + 0.5 - 1.0) / 5, terms=6)


def test_gradient_is_zero_where_the_clipped_branch_wins():
    v, old, ret, mask = tensors()
    loss, _ = clipped_value_loss(v, old, ret, mask, cliprange_value=0.2)
    loss.backward()
    # (0,0), (0,1), (1,1): the clipped value is a constant of V -> 0; (0,2), (1,0): V inside the clip range, both
    # branches equal, d/dV ½·(V − R)²/5 = (V − R)/5; (1,2): masked
    expected = torch.tensor([[0.0, 0.0, (0.0 - 1.0) / 5], [(0.5 - 0.0) / 5, 0.0, 0.0]])
    assert_close(v.grad, expected)  # (V - R) / 5: a subtraction and a division


def test_infinite_clip_range_is_the_plain_squared_error():
    v, old, ret, mask = tensors()
    loss, metrics = clipped_value_loss(v, old, ret, mask, cliprange_value=math.inf)
    assert loss.item() == approx(0.5 * (1.0 + 0.0 + 1.0 + 0.25 + 1.0) / 5, terms=6)
    assert metrics["vf_clipfrac"].item() == 0.0


def test_old_values_and_returns_carry_no_gradient():
    v, old, ret, mask = tensors()
    old.requires_grad_(True)
    ret.requires_grad_(True)
    loss, _ = clipped_value_loss(v, old, ret, mask, cliprange_value=0.2)
    loss.backward()
    assert old.grad is None and ret.grad is None


def test_nan_and_inf_in_padding_do_not_leak():
    nan, inf = float("nan"), float("inf")
    clean_v, old, ret, mask = tensors()
    clean, _ = clipped_value_loss(clean_v, old, ret, mask, cliprange_value=0.2)
    clean.backward()
    v, old, ret, mask = tensors(
        values=[[1.0, 2.0, 0.0], [0.5, -1.0, nan]],
        old=[[0.0, 2.5, 0.0], [0.5, 0.0, inf]],
        returns=[[2.0, 2.0, 1.0], [0.0, -2.0, nan]],
    )
    loss, metrics = clipped_value_loss(v, old, ret, mask, cliprange_value=0.2)
    loss.backward()
    assert loss.item() == approx(clean.item(), terms=6)
    assert all(math.isfinite(float(m)) for m in metrics.values())
    assert torch.isfinite(v.grad).all() and v.grad[1, 2] == 0.0
    assert_close(v.grad, clean_v.grad)


def test_empty_mask_gives_zero_loss_and_zero_gradient():
    v, old, ret, _ = tensors()
    empty = torch.zeros(2, 3, dtype=torch.bool)
    loss, metrics = clipped_value_loss(v, old, ret, empty, cliprange_value=0.2)
    loss.backward()
    assert loss.item() == 0.0 and metrics["vf_clipfrac"].item() == 0.0
    assert torch.equal(v.grad, torch.zeros(2, 3))


def test_float_mask_is_a_weight():
    v, old, ret, _ = tensors()
    weights = torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    loss, _ = clipped_value_loss(v, old, ret, weights, cliprange_value=0.2)
    # one token of weight 2: MMEAN = 2·3.24 / 2
    assert loss.item() == approx(0.5 * 3.24, terms=6)


@pytest.mark.parametrize("bad", [0.0, -0.1, float("nan"), "0.2", None])
def test_bad_clip_range(bad):
    v, old, ret, mask = tensors()
    with pytest.raises(ValueError, match="cliprange_value"):
        clipped_value_loss(v, old, ret, mask, cliprange_value=bad)


def test_bad_shapes_and_mode():
    v, old, ret, mask = tensors()
    with pytest.raises(ValueError, match=r"must all be \(B, T\)"):
        clipped_value_loss(v, old[:, :2], ret, mask, cliprange_value=0.2)
    with pytest.raises(ValueError, match=r"must all be \(B, T\)"):
        clipped_value_loss(v[0], old[0], ret[0], mask[0], cliprange_value=0.2)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        clipped_value_loss(v, old, ret, mask, cliprange_value=0.2, loss_agg_mode="sum")

"""tests/tolerance.py itself: the tolerance follows from the dtype, the reduction length and the scale, it accepts a
rounding-order difference and rejects an O(1) error (what a wrong mask, a dropped token or an off-by-one gives)."""

from __future__ import annotations

import math

import pytest
import torch
from tolerance import DEFAULT_ULPS, approx, assert_close, tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("terms", [1, 4, 1024])
def test_rtol_is_ulps_times_eps_times_root_terms(dtype, terms):
    tol = tolerance(dtype, terms=terms)
    assert tol["rtol"] == pytest.approx(DEFAULT_ULPS * torch.finfo(dtype).eps * math.sqrt(terms), rel=1e-12)


def test_the_dtype_comes_from_the_values_or_is_given():
    assert tolerance(torch.ones(3))["rtol"] == tolerance(torch.float32)["rtol"]
    assert tolerance(torch.ones(3, dtype=torch.float64))["rtol"] == tolerance(torch.float64)["rtol"]
    assert tolerance(1.5)["rtol"] == tolerance(torch.float64)["rtol"]  # a Python float is a double
    assert tolerance(torch.arange(3))["rtol"] == tolerance(torch.float64)["rtol"]  # integers: exact in float64
    # values upcast for the comparison: the dtype they were computed in decides
    assert (
        tolerance(torch.ones(3, dtype=torch.float64), dtype=torch.float32)["rtol"] == tolerance(torch.float32)["rtol"]
    )
    # a float32 tolerance is about 2**29 times a float64 one
    assert tolerance(torch.float32)["rtol"] / tolerance(torch.float64)["rtol"] == pytest.approx(2.0**29)


def test_more_terms_and_more_ulps_widen_the_tolerance():
    assert tolerance(torch.float32, terms=100)["rtol"] == pytest.approx(10 * tolerance(torch.float32)["rtol"])
    assert tolerance(torch.float32, ulps=2)["rtol"] == pytest.approx(tolerance(torch.float32)["rtol"] / 4)


def test_atol_is_rtol_times_the_scale():
    values = torch.tensor([0.5, -3.0, 2.0])
    tol = tolerance(values, terms=16)
    assert tol["atol"] == pytest.approx(tol["rtol"] * 3.0)  # the largest magnitude compared
    given = tolerance(values, terms=16, scale=100.0)  # the magnitude of the summed terms, when they cancel
    assert given["rtol"] == tol["rtol"] and given["atol"] == pytest.approx(tol["rtol"] * 100.0)
    assert tolerance(values, scale=torch.tensor(2.0, requires_grad=True))["atol"] == pytest.approx(
        tolerance(values)["rtol"] * 2.0
    )
    # non-finite values do not set the scale; empty and all-zero tensors still give a positive atol
    assert tolerance(torch.tensor([1.0, math.inf, math.nan]))["atol"] == pytest.approx(tolerance(torch.float32)["rtol"])
    assert tolerance(torch.empty(0))["atol"] > 0 and tolerance(torch.zeros(3))["atol"] > 0


def test_known_rtol_adds_to_the_rounding_bound():
    base = tolerance(torch.float64, terms=4)["rtol"]
    assert tolerance(torch.float64, terms=4, known_rtol=1e-8)["rtol"] == pytest.approx(base + 1e-8)


@pytest.mark.parametrize("terms", [0, -3])
def test_fewer_than_one_term_is_refused(terms):
    with pytest.raises(ValueError, match="terms must be >= 1"):
        tolerance(torch.float32, terms=terms)
    with pytest.raises(ValueError, match="terms must be >= 1"):
        assert_close(torch.ones(2), torch.ones(2), terms=terms)


def test_a_negative_known_rtol_is_refused():
    with pytest.raises(ValueError, match="known_rtol must be >= 0"):
        tolerance(torch.float32, known_rtol=-1e-8)


def test_a_sum_in_another_order_passes_and_an_o1_error_fails():
    generator = torch.Generator().manual_seed(0)
    terms = torch.randn(64, 4096, generator=generator)
    forward = terms.sum(1)
    # the same sums in another order (reversed, in blocks, pairwise), all in float32
    blocked = terms.flip(1).view(64, 64, 64).sum(2).sum(1)
    assert not torch.equal(forward, blocked)  # rounding really differs
    assert_close(blocked, forward, terms=4096, scale=terms.abs().max())
    # an O(1) error of one term (a dropped token, a wrong mask entry, a value moved by one position)
    dropped = forward - terms[:, 7]
    with pytest.raises(AssertionError):
        assert_close(dropped, forward, terms=4096, scale=terms.abs().max())
    shifted = torch.cat([terms[:, 1:], terms[:, :1] * 0], 1).sum(1)
    with pytest.raises(AssertionError):
        assert_close(shifted, forward, terms=4096, scale=terms.abs().max())


def test_a_float32_matmul_against_float64_is_within_the_bound():
    generator = torch.Generator().manual_seed(1)
    a, b = torch.randn(32, 512, generator=generator), torch.randn(512, 16, generator=generator)
    exact = a.double() @ b.double()
    # each product a_ik b_kj is about 1 in magnitude: the scale of the summed terms
    assert_close((a @ b).double(), exact, terms=512, dtype=torch.float32, scale=(a.abs().max() * b.abs().max()))


def test_approx_uses_the_same_tolerance():
    value = 1.0 / 3.0
    assert float(torch.tensor(value)) == approx(value)  # float32 rounding of a double
    assert float(torch.tensor(value)) != approx(value, dtype=torch.float64)  # not within float64's bound
    assert [1.0, 2.0] == approx([1.0 + 1e-7, 2.0 - 1e-7])
    assert 1.0 + 1e-3 != approx(1.0, terms=1024)


def test_assert_close_passes_options_through():
    nan = torch.tensor([1.0, math.nan])
    assert_close(nan, nan.clone(), equal_nan=True)
    with pytest.raises(AssertionError):
        assert_close(nan, nan.clone())
    assert_close(1.0, 1.0 + 1e-17)  # Python floats compare as float64

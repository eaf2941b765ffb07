"""Tolerances derived from floating-point arithmetic, for every approximate comparison of the suite.

Two computations of the same quantity that sum the same terms in a different order (another SDPA kernel,
another BLAS blocking, another thread count, a packed row instead of padded rows) differ by rounding alone.
For a sum of ``n`` terms each rounding contributes at most one unit roundoff ``u = eps / 2`` of the running
sum; the errors are independent in practice, so the difference grows like ``sqrt(n) * u`` relative to the
magnitude of the terms (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., section 4.2 and
the probabilistic bound of section 2.8). Hence:

* ``rtol = ulps * eps(dtype) * sqrt(terms)``: ``terms`` is the length of the longest chain of additions
  behind one compared value (the keys of an attention row times the head dimension for an attention
  output or its gradient; the tokens of a sequence for a summed log-prob; the elements of a reduced
  tensor for a loss), ``ulps`` a small factor for the few elementwise operations around the sums
  (``exp``, a division, a subtraction, and the two computations each rounding on its own);
* ``atol = rtol * scale``: values near zero come from cancelling terms, whose error is relative to the
  terms, not to the result; ``scale`` is their magnitude, by default the largest absolute value compared.

A real bug (a wrong mask, a dropped token, an off-by-one position) changes values by O(1) of their scale,
many orders of magnitude beyond these bounds: ``tests/test_tolerance.py`` shows that it still fails.

Exact comparisons (``torch.equal``, ``==``) stay where the two sides run the same kernels on the same
inputs (bit parity with TRL's own code on the same path, integer and boolean results, a copy compared
with its source): each such test says so where it compares.
"""

from __future__ import annotations

import math
from typing import Any

import torch

#: the default number of roundings per compared value beyond the sum itself (see the module docs)
DEFAULT_ULPS = 8.0


def _dtype_of(like: Any) -> torch.dtype:
    if isinstance(like, torch.dtype):
        return like
    if isinstance(like, torch.Tensor):
        return like.dtype if like.is_floating_point() else torch.float64
    return torch.float64  # Python floats


def _magnitude(like: Any) -> float:
    if isinstance(like, torch.Tensor):
        if like.numel() == 0:
            return 1.0
        finite = like.detach().double()
        finite = finite[torch.isfinite(finite)]
        return float(finite.abs().max()) if finite.numel() else 1.0
    if isinstance(like, (int, float)):
        return abs(float(like)) if math.isfinite(like) else 1.0
    if isinstance(like, (list, tuple)):
        return max((_magnitude(x) for x in like), default=1.0)
    return 1.0


def tolerance(
    like: Any,
    *,
    terms: int = 1,
    ulps: float = DEFAULT_ULPS,
    scale: float | None = None,
    dtype: torch.dtype = None,
    known_rtol: float = 0.0,
) -> dict[str, float]:
    """``{"rtol": ..., "atol": ...}`` for comparing values like ``like`` (a tensor, a dtype or a float).

    Args:
        like: the expected values (their dtype and magnitude are used), or a dtype.
        terms: the length of the longest chain of additions behind one compared value (>= 1).
        ulps: roundings per value beyond the sum (see the module docs).
        scale: the magnitude of the summed terms, when it differs from the largest compared value (for
            example a gradient that cancels to nearly zero): ``atol = rtol * scale``.
        dtype: the dtype the values were computed in, when ``like`` was upcast for comparison.
        known_rtol: a relative difference that is not rounding but known and bounded, added to ``rtol`` (for
            example the spec's ``+ 1e-8`` in a masked mean's denominator: at most ``1e-8`` relative for counts >= 1).
    """
    if terms < 1:
        raise ValueError(f"terms must be >= 1, got {terms}")
    eps = torch.finfo(dtype or _dtype_of(like)).eps
    if known_rtol < 0:
        raise ValueError(f"known_rtol must be >= 0, got {known_rtol}")
    rtol = ulps * eps * math.sqrt(terms) + known_rtol
    if isinstance(scale, torch.Tensor):
        scale = scale.detach()
    magnitude = _magnitude(like) if scale is None else float(scale)
    return {"rtol": rtol, "atol": rtol * max(magnitude, torch.finfo(torch.float32).tiny)}


def assert_close(
    actual: Any,
    expected: Any,
    *,
    terms: int = 1,
    ulps: float = DEFAULT_ULPS,
    scale=None,
    dtype=None,
    known_rtol: float = 0.0,
    msg: str | None = None,
    **kwargs,
) -> None:
    """``torch.testing.assert_close`` with :func:`tolerance` of ``expected``; extra ``kwargs`` (``equal_nan``,
    ``check_dtype``...) pass through."""
    tol = tolerance(expected, terms=terms, ulps=ulps, scale=scale, dtype=dtype, known_rtol=known_rtol)
    if not isinstance(actual, torch.Tensor) and not isinstance(expected, torch.Tensor):
        actual, expected = torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(actual, expected, **tol, msg=msg, **kwargs)


def approx(
    expected: float,
    *,
    dtype: torch.dtype = torch.float32,
    terms: int = 1,
    ulps: float = DEFAULT_ULPS,
    scale: float | None = None,
    known_rtol: float = 0.0,
):
    """``pytest.approx(expected)`` with :func:`tolerance` of a value computed in ``dtype``."""
    import pytest

    tol = tolerance(expected, terms=terms, ulps=ulps, scale=scale, dtype=dtype, known_rtol=known_rtol)
    return pytest.approx(expected, rel=tol["rtol"], abs=tol["atol"])

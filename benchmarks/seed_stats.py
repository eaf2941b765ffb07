"""Tests over seeds for the learning studies: a paired t-test with its confidence interval, and Holm's correction.

The seed is the unit of replication (every held-out problem of a seed is scored by the same trained adapter, and the
same problems recur in every seed), so a comparison of two methods is one difference per seed. Student's t
distribution is computed here from the regularised incomplete beta function (continued fraction), so the
benchmarks need no SciPy.
"""

from __future__ import annotations

import math
import statistics


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function I_x(a, b) (modified Lentz method)."""
    tiny = 1e-300

    def guard(value: float) -> float:
        return value if abs(value) > tiny else tiny

    c, d = 1.0, 1.0 / guard(1.0 - (a + b) * x / (a + 1.0))
    result = d
    for m in range(1, 500):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 / guard(1.0 + numerator * d)
            c = guard(1.0 + numerator / c)
            result *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return result


def incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b), for a, b > 0 and 0 <= x <= 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_continued_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_continued_fraction(b, a, 1.0 - x) / b


def t_two_sided_p(t: float, df: int) -> float:
    """P(|T| >= |t|) for Student's t with ``df`` degrees of freedom."""
    return incomplete_beta(df / 2.0, 0.5, df / (df + t * t))


def t_quantile(probability: float, df: int) -> float:
    """The ``probability`` quantile (> 0.5) of Student's t with ``df`` degrees of freedom (bisection)."""
    if not 0.5 < probability < 1.0:
        raise ValueError(f"probability must be in (0.5, 1), got {probability}")
    low, high = 0.0, 1.0
    while 1.0 - t_two_sided_p(high, df) / 2.0 < probability:
        high *= 2.0
    for _ in range(200):
        middle = (low + high) / 2.0
        if 1.0 - t_two_sided_p(middle, df) / 2.0 < probability:
            low = middle
        else:
            high = middle
    return (low + high) / 2.0


def paired_t(differences: list[float], confidence: float = 0.95) -> dict:
    """One-sample t-test of the per-seed ``differences`` against 0: ``{n, mean, std, t, df, p, low, high}`` (two-sided
    p, the ``confidence`` interval of the mean difference). With fewer than 2 seeds, or differences that do not
    vary, ``t``, ``p`` and the interval are ``None``."""
    n = len(differences)
    out: dict = {"n": n, "mean": statistics.mean(differences) if n else None, "std": None, "t": None, "df": n - 1}
    out.update(p=None, low=None, high=None)
    if n < 2:
        return out
    std = statistics.stdev(differences)
    out["std"] = std
    if std == 0.0:
        return out
    error = std / math.sqrt(n)
    half = t_quantile(0.5 + confidence / 2.0, n - 1) * error
    out.update(t=out["mean"] / error, low=out["mean"] - half, high=out["mean"] + half)
    out["p"] = t_two_sided_p(out["t"], n - 1)
    return out


def holm(p_values: dict[str, float | None]) -> dict[str, float | None]:
    """Holm's step-down adjusted p-values (family-wise error) of the named tests; a ``None`` stays ``None`` and does
    not count in the family."""
    known = sorted((p, name) for name, p in p_values.items() if p is not None)
    adjusted: dict[str, float | None] = {name: None for name in p_values}
    running = 0.0
    for rank, (p, name) in enumerate(known):
        running = max(running, min(1.0, (len(known) - rank) * p))
        adjusted[name] = running
    return adjusted

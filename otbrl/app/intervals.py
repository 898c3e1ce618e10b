"""Student-t intervals for comparing arms over seeds, with the standard library alone (the application
does not depend on scipy): the t quantile by Newton's method on the t distribution function, itself
integrated numerically, and the paired interval of a mean difference."""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


def _t_density(x: float, df: float) -> float:
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    return math.exp(log_norm - (df + 1) / 2 * math.log1p(x * x / df))


def _t_cdf(t: float, df: float, panels: int = 2000) -> float:
    """P(T <= t) = 1/2 + the density integrated from 0 to t (composite Simpson rule; the density is smooth,
    so 2,000 panels give ~1e-12 for the t values an interval uses)."""
    h = t / panels
    inner = [_t_density(i * h, df) * (4 if i % 2 else 2) for i in range(1, panels)]
    return 0.5 + h / 3 * math.fsum([_t_density(0.0, df), *inner, _t_density(t, df)])


@functools.lru_cache(maxsize=256)
def t_quantile(p: float, df: float) -> float:
    """The p quantile of Student's t with `df` degrees of freedom (df > 0, 0 < p < 1), to ~1e-9."""
    if not 0 < p < 1:
        raise ValueError(f"p: must lie in (0, 1), got {p}")
    if not df > 0:
        raise ValueError(f"df: must be > 0, got {df}")
    if p < 0.5:
        return -t_quantile(1 - p, df)
    t = statistics.NormalDist().inv_cdf(p)  # a start below the root: t's tails are heavier
    for _ in range(100):
        step = (_t_cdf(t, df) - p) / _t_density(t, df)
        t -= step
        if abs(step) < 1e-10 * max(1.0, abs(t)):
            return t
    raise ArithmeticError(f"t quantile did not converge for p={p}, df={df}")


@dataclass(frozen=True)
class Interval:
    """A mean with its two-sided t interval over n values (lo = hi = mean when n < 2)."""

    mean: float
    lo: float
    hi: float
    n: int

    def __str__(self) -> str:
        if self.n < 2:
            return f"{self.mean:+.3f} (n={self.n}: no interval)"
        return f"{self.mean:+.3f} [{self.lo:+.3f}, {self.hi:+.3f}]"


def mean_interval(values: Sequence[float], confidence: float = 0.95) -> Interval:
    """The t interval of the mean of `values` (for paired differences: one value per seed)."""
    if not values:
        raise ValueError("values: need at least one value")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence: must lie in (0, 1), got {confidence}")
    n, mean = len(values), statistics.fmean(values)
    if n < 2:
        return Interval(mean, mean, mean, n)
    half = t_quantile(0.5 + confidence / 2, n - 1) * statistics.stdev(values) / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n)

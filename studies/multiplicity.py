"""Multiplicity across the claims page: with many claims tested at 95% each, some "held" verdicts would
come by chance. Holm's step-down procedure keeps the family-wise error at 5%: sort the m p-values, and
reject the k-th smallest only if every smaller one was rejected and p_(k) <= alpha / (m - k + 1).

A p-value here is the two-sided one that matches the verdict rule's interval: a claim reads "held" when
its 95% t interval clears the decision point, which is exactly p < 0.05 below."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from studies.inference import scipy_stats


def p_above(iv: Mapping[str, float], floor: float) -> float:
    """Two-sided p of "the mean difference lies above `floor`" from its t interval {mean, lo, hi, n,
    confidence}: 2 P(T_{n-1} >= (mean - floor) / se), se read back from the interval's half-width."""
    n, mean, lo, hi = int(iv["n"]), iv["mean"], iv["lo"], iv["hi"]
    if n < 2 or any(v is None or v != v for v in (mean, lo, hi)):
        return math.nan
    t = scipy_stats().t
    se = (hi - lo) / (2 * t.ppf(0.5 + iv["confidence"] / 2, n - 1))
    if se <= 0:
        return 0.0 if mean > floor else 1.0
    return min(1.0, 2 * t.sf((mean - floor) / se, n - 1))


def p_ratio_below(iv: Mapping[str, float], ceiling: float = 1.0) -> float:
    """Two-sided p of "the ratio lies below `ceiling`" from a ratio's interval on the log scale {ratio,
    log_se, k}: 2 P(T_{k-1} >= (log ceiling - log ratio) / log_se)."""
    ratio, se, k = iv.get("ratio"), iv.get("log_se"), int(iv.get("k", 0))
    if k < 2 or not ratio or ratio != ratio or not se or se != se or ratio <= 0:
        return math.nan
    return min(1.0, 2 * scipy_stats().t.sf((math.log(ceiling) - math.log(ratio)) / se, k - 1))


def holm(pvalues: Sequence[float], alpha: float = 0.05) -> list[bool]:
    """Which hypotheses Holm's procedure rejects at family-wise level `alpha`; a NaN p (no test) is never
    rejected and counts in m."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: math.inf if pvalues[i] != pvalues[i] else pvalues[i])
    rejected = [False] * m
    for rank, i in enumerate(order):
        p = pvalues[i]
        if p != p or p > alpha / (m - rank):
            break
        rejected[i] = True
    return rejected

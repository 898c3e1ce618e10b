"""How many paired seeds a comparison needs: the power of its verdict rule, from the SD of its paired
per-seed differences (measured on the pilot's variance seeds).

A comparison's verdict is read from the t interval of the mean paired difference d (candidate minus
baseline) over n seeds. `matches` with margin m holds when the interval's lower end lies above -m; `better`
when it lies above 0. If the true difference is `delta` and the differences are normal with SD sigma,
(mean - floor) / (s / sqrt(n)) follows a noncentral t with n - 1 degrees of freedom and noncentrality
(delta - floor) sqrt(n) / sigma, so the chance the rule says held is one minus its CDF at the t quantile.
The SD a plan uses is an upper confidence limit of the pilot's (a few seeds estimate it poorly): with k
differences and sample SD s, s sqrt((k - 1) / chi2_{1-q}(k - 1)) at one-sided level q.
"""

from __future__ import annotations

import math
import statistics


def power(n: int, sd: float, floor: float, delta: float = 0.0, confidence: float = 0.95) -> float:
    """Chance that the lower end of a two-sided t interval (at `confidence`) of the mean of n paired
    differences lies above `floor`, when they are normal with mean `delta` and SD `sd`."""
    from scipy import stats

    if n < 2:
        return 0.0
    if sd <= 0:
        return 1.0 if delta > floor else 0.0
    crit = stats.t.ppf(0.5 + confidence / 2, n - 1)
    return float(stats.nct.sf(crit, n - 1, (delta - floor) * math.sqrt(n) / sd))


def seeds_needed(sd: float, floor: float, delta: float = 0.0, confidence: float = 0.95, target: float = 0.8,
                 most: int = 200) -> int | None:  # fmt: skip
    """The fewest seeds (>= 2) whose power reaches `target`; None if not within `most`."""
    for n in range(2, most + 1):
        if power(n, sd, floor, delta, confidence) >= target:
            return n
    return None


def sd_upper(values: list[float], level: float = 0.8) -> float:
    """The one-sided upper `level` confidence limit of the SD of `values` (normal, chi-squared)."""
    from scipy import stats

    k = len(values)
    if k < 2:
        return math.nan
    return statistics.stdev(values) * math.sqrt((k - 1) / stats.chi2.ppf(1 - level, k - 1))


def plan(diffs: list[float], kind: str, margin: float, effect: float, confidence: float = 0.95,
         target: float = 0.8, level: float = 0.8) -> dict[str, float | int | None]:  # fmt: skip
    """The power calculation of one comparison from the pilot's paired differences: `matches` assumes a
    true difference of 0 against the floor -margin; `better` assumes a true difference of `effect`
    against the floor 0."""
    floor, delta = (-abs(margin), 0.0) if kind == "matches" else (0.0, effect)
    sd = sd_upper(diffs, level)
    n = seeds_needed(sd, floor, delta, confidence, target) if math.isfinite(sd) else None
    return {
        "pilot_seeds": len(diffs),
        "pilot_sd": statistics.stdev(diffs) if len(diffs) > 1 else math.nan,
        "sd_planned": sd,
        "floor": floor,
        "delta": delta,
        "seeds": n,
    }

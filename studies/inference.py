"""Paired comparisons between two arms of an experiment, the verdict rules of claims.md, and how many
seeds a comparison needs for its verdict rule to have power.

Arms of one seed share their warm start, their prompts at every step and their held-out prompts, so a
comparison is made per seed (candidate minus baseline) and the per-seed differences get a Student t
interval: with 3-5 seeds the normal quantile would understate the width by up to 2x.

Verdicts, one of four:
- `better` claims (the candidate improves on the baseline): held if the interval lies above 0, did not
  hold if it lies below 0, inconclusive if it spans 0;
- `matches` claims (the candidate is no worse than the baseline, within `margin`): held if the interval
  lies above -margin, did not hold if it lies below -margin, inconclusive otherwise;
- not tested when fewer than two seeds pair up, or when the phenomenon the claim is about did not occur.

Power (`power_plan`): how many paired seeds a comparison needs, from the power of its verdict rule and
the SD of its paired per-seed differences (measured on the pilot's variance seeds).

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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

HELD, NOT_HELD, INCONCLUSIVE, NOT_TESTED = "held", "did not hold", "inconclusive", "not tested"
NOT_DISCRIMINATING = "not discriminating"  # a `matches` claim that a same-N baseline passes too
# a comparison looked at before every planned seed has run: its rule is read at the planned seeds only, so
# it has no verdict yet (smollm2 read "held" at 3 of its 8 seeds and "inconclusive" at 8)
IN_PROGRESS = "in progress"


def scipy_stats() -> Any:
    """`scipy.stats`, imported on first use: it is heavy (about half a second) and an optional dependency
    (otbrl[trl]), and only the studies' intervals and power need it."""
    from scipy import stats

    return stats


@dataclass(frozen=True)
class Interval:
    """Mean of n paired differences and its two-sided t interval at `confidence` (lo = hi = nan, n < 2)."""

    mean: float
    lo: float
    hi: float
    n: int
    confidence: float

    def __str__(self) -> str:
        return self.text()

    def text(self, thousands: bool = False) -> str:
        """'+0.012 [-0.004, +0.028] (n=5)'; thousands: '+1.2k [-0.4k, +2.8k] (n=5)'."""
        f = (lambda v: f"{v / 1000:+.1f}k") if thousands else (lambda v: f"{v:+.3f}")
        if self.n == 0:
            return "— (n=0)"
        if self.n < 2:
            return f"{f(self.mean)} (n=1, no interval)"
        return f"{f(self.mean)} [{f(self.lo)}, {f(self.hi)}] (n={self.n})"


def t_interval(values: list[float], confidence: float = 0.95) -> Interval:
    """Student t interval for the mean of `values` (independent draws, e.g. one per seed)."""
    stats = scipy_stats()
    if not 0 < confidence < 1:
        raise ValueError(f"confidence: must be in (0, 1), got {confidence}")
    values = [float(v) for v in values]
    if any(not math.isfinite(v) for v in values):
        raise ValueError(f"values: must be finite, got {values}")
    n = len(values)
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0, confidence)
    mean = statistics.fmean(values)
    if n < 2:
        return Interval(mean, math.nan, math.nan, n, confidence)
    half = stats.t.ppf(0.5 + confidence / 2, n - 1) * statistics.stdev(values) / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n, confidence)


def paired(candidate: Mapping[int, float], baseline: Mapping[int, float]) -> list[float]:
    """Per-seed differences candidate - baseline over the seeds both have (in seed order)."""
    return [candidate[s] - baseline[s] for s in sorted(set(candidate) & set(baseline))]


def verdict(kind: str, interval: Interval, margin: float = 0.0) -> str:
    """The verdict of a `better` or `matches` claim from the interval of candidate - baseline."""
    if kind not in ("better", "matches"):
        raise ValueError(f"kind: 'better' or 'matches', got {kind!r}")
    if interval.n < 2:
        return NOT_TESTED
    floor = 0.0 if kind == "better" else -abs(margin)
    if interval.lo > floor:
        return HELD
    if interval.hi < floor:
        return NOT_HELD
    return INCONCLUSIVE


def rule(kind: str, margin: float = 0.0, confidence: float = 0.95) -> str:
    """The verdict rule in words, as claims.md states it next to each verdict."""
    ci = f"the {confidence:.0%} t interval of the paired per-seed difference"
    if kind == "better":
        return (
            f"held if {ci} lies above 0, did not hold if below 0, inconclusive if it spans 0, "
            "not tested if fewer than 2 seeds pair up"
        )
    return (
        f"held if {ci} lies above -{abs(margin):g}, did not hold if below -{abs(margin):g}, "
        "inconclusive otherwise, not tested if fewer than 2 seeds pair up"
    )


def discriminating(candidate: str, controls: Mapping[str, str]) -> str:
    """A `matches` verdict that singles out the candidate (issue 33): `candidate` is its own verdict against
    the reference, `controls` each same-N baseline's verdict on the same test. Held only if the candidate
    passes and no same-N baseline does; if one does too, the test cannot tell them apart."""
    if candidate == HELD and any(v == HELD for v in controls.values()):
        return NOT_DISCRIMINATING
    return candidate


def verdict_text(c: Mapping[str, Any]) -> str:
    """A comparison's verdict, naming the same-N baselines that make a `matches` claim not discriminating."""
    if c["verdict"] != NOT_DISCRIMINATING:
        return c["verdict"]
    passing = [k["arm"] for k in c.get("controls", []) if k["verdict"] == HELD]
    return f"{NOT_DISCRIMINATING}: {', '.join(passing)} passes too"


MATCHES_RULE = (
    "and held only if no same-N baseline (each at its own rate) passes the same test against the same "
    "reference: if one does, not discriminating"
)


def combine(verdicts: list[str]) -> str:
    """One verdict from several (e.g. one per token budget): held or did not hold only if all agree;
    not tested only if nothing was tested; inconclusive otherwise."""
    tested = [v for v in verdicts if v != NOT_TESTED]
    if not tested:
        return NOT_TESTED
    if all(v == HELD for v in tested):
        return HELD
    if all(v == NOT_HELD for v in tested):
        return NOT_HELD
    return INCONCLUSIVE


def power(n: int, sd: float, floor: float, delta: float = 0.0, confidence: float = 0.95) -> float:
    """Chance that the lower end of a two-sided t interval (at `confidence`) of the mean of n paired
    differences lies above `floor`, when they are normal with mean `delta` and SD `sd`."""
    stats = scipy_stats()
    if n < 2:
        return 0.0
    if sd <= 0:
        return 1.0 if delta > floor else 0.0
    crit = stats.t.ppf(0.5 + confidence / 2, n - 1)
    return float(stats.nct.sf(crit, n - 1, (delta - floor) * math.sqrt(n) / sd))


def seeds_needed(
    sd: float,
    floor: float,
    delta: float = 0.0,
    confidence: float = 0.95,
    target: float = 0.8,
    most: int = 100_000,
) -> int | None:
    """The fewest seeds (>= 2) whose power reaches `target`; None if not within `most`. Power rises with
    n when delta > floor (the interval narrows and its centre stays), so a doubling search and bisection
    find it in a few dozen evaluations even where a plan calls for thousands of seeds."""
    if power(2, sd, floor, delta, confidence) >= target:
        return 2
    low, high = 2, 4  # power(low) < target throughout
    while power(high, sd, floor, delta, confidence) < target:
        if high >= most:
            return None
        low, high = high, min(2 * high, most)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if power(mid, sd, floor, delta, confidence) >= target else (mid, high)
    return high


def sd_upper(values: list[float], level: float = 0.8) -> float:
    """The one-sided upper `level` confidence limit of the SD of `values` (normal, chi-squared)."""
    stats = scipy_stats()
    k = len(values)
    if k < 2:
        return math.nan
    return statistics.stdev(values) * math.sqrt((k - 1) / stats.chi2.ppf(1 - level, k - 1))


def power_plan(
    diffs: list[float],
    kind: str,
    margin: float,
    effect: float,
    confidence: float = 0.95,
    target: float = 0.8,
    level: float = 0.8,
) -> dict[str, float | int | None]:
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

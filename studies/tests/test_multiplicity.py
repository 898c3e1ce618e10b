"""Holm's procedure and the p-values that match the claims' 95% interval rules."""

from __future__ import annotations

import math

import pytest

from studies.inference import t_interval, verdict
from studies.multiplicity import holm, p_above, p_ratio_below


def test_holm_steps_down_and_stops_at_the_first_failure():
    # m = 4: thresholds 0.0125, 0.0167, 0.025, 0.05 for the sorted p-values
    assert holm([0.01, 0.04, 0.03, 0.005]) == [True, False, False, True]  # 0.03 > 0.05 / 2: stop
    assert holm([0.01, 0.04, 0.02, 0.005]) == [True, True, True, True]
    assert holm([0.013, 0.04, 0.03, 0.005]) == [True, False, False, True]  # 0.03 > 0.05 / 2: stop
    assert holm([0.02, 0.04, 0.03, 0.005]) == [False, False, False, True]  # 0.02 > 0.05 / 3: stop
    assert holm([0.001, math.nan, 0.03]) == [True, False, False]  # nan counts in m: 0.03 > 0.05 / 2
    assert holm([0.001, math.nan, 0.02]) == [True, False, True]  # without the nan 0.02 would face 0.05
    assert holm([]) == []


@pytest.mark.parametrize("values", [[0.1, 0.12, 0.14], [0.02, -0.01, 0.05, 0.0], [0.03, 0.01, -0.02]])
@pytest.mark.parametrize(("kind", "margin"), [("better", 0.0), ("matches", 0.03)])
def test_p_below_005_exactly_when_the_interval_rule_says_held(values, kind, margin):
    ci = t_interval(values, 0.95)
    iv = {"mean": ci.mean, "lo": ci.lo, "hi": ci.hi, "n": ci.n, "confidence": 0.95}
    p = p_above(iv, 0.0 if kind == "better" else -margin)
    assert (p < 0.05) == (verdict(kind, ci, margin) == "held")


def test_p_of_a_ratio_on_the_log_scale():
    stats = pytest.importorskip("scipy.stats")
    iv = {"ratio": 0.5, "log_se": 0.2, "k": 11}
    expected = 2 * stats.t.sf(math.log(2) / 0.2, 10)
    assert p_ratio_below(iv) == pytest.approx(expected)
    assert math.isnan(p_ratio_below({"ratio": math.nan, "log_se": 0.2, "k": 11}))

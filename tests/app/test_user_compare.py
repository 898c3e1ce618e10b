"""`otbrl compare`: the paired table against the first arm, the t intervals it uses (no scipy in the
package: checked against scipy here), and clear errors before anything trains."""

from __future__ import annotations

import math

import pytest

from otbrl.app.compare import comparison_table, train_arms
from otbrl.app.intervals import mean_interval, t_quantile


@pytest.mark.parametrize("df", [1, 2, 3, 5, 9, 30, 200])
@pytest.mark.parametrize("p", [0.6, 0.9, 0.975, 0.995])
def test_t_quantile_matches_scipy(p, df):
    stats = pytest.importorskip("scipy.stats")
    assert t_quantile(p, df) == pytest.approx(stats.t.ppf(p, df), rel=1e-9, abs=1e-10)
    assert t_quantile(1 - p, df) == pytest.approx(-t_quantile(p, df))


def test_mean_interval_is_the_textbook_t_interval():
    values = [0.1, 0.3, -0.05, 0.2]
    iv = mean_interval(values)
    mean = sum(values) / 4
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / 3)
    half = 3.182446305284263 * sd / 2  # t_{0.975, 3} (tables)
    assert (iv.mean, iv.lo, iv.hi, iv.n) == pytest.approx((mean, mean - half, mean + half, 4))
    one = mean_interval([0.4])
    assert (one.lo, one.hi) == (0.4, 0.4) and "no interval" in str(one)
    with pytest.raises(ValueError, match="values"):
        mean_interval([])
    with pytest.raises(ValueError, match="p"):
        t_quantile(1.0, 3)


def _summary(after: float, before: float = 0.2) -> dict:
    return {"held-out reward before": before, "held-out reward after": after, "generated tokens": 1000}


def test_the_table_pairs_each_arm_with_the_first_by_seed():
    summaries = {
        "otb": {0: _summary(0.5), 1: _summary(0.6), 2: _summary(0.7)},
        "grpo": {0: _summary(0.4), 1: _summary(0.6), 2: _summary(0.5)},
    }
    table = comparison_table(summaries)
    diffs = [0.4 - 0.5, 0.6 - 0.6, 0.5 - 0.7]
    assert str(mean_interval(diffs)) in table.splitlines()[-1]
    assert table.splitlines()[2].startswith("| otb | 3 | 0.200 | 0.600 |")
    # Paired, not two-sample: a constant shift has a zero-width interval.
    shifted = {
        "otb": summaries["otb"],
        "grpo": {k: _summary(v["held-out reward after"] - 0.1) for k, v in summaries["otb"].items()},
    }
    assert "-0.100 [-0.100, -0.100]" in comparison_table(shifted)


def test_bad_arms_and_seeds_fail_before_training(tmp_path):
    with pytest.raises(ValueError, match="arms"):
        train_arms("demo", ["otb"], [0], tmp_path, {})
    with pytest.raises(ValueError, match="seeds"):
        train_arms("demo", ["otb", "grpo"], [1, 1], tmp_path, {})
    with pytest.raises(ValueError, match="advantage_estimator"):  # checked for every arm up front
        train_arms("demo", ["otb", "nope"], [0], tmp_path, {})
    assert not any(tmp_path.iterdir())

"""studies.phenomenon: each run's phenomenon value read from committed records at the arms' own rates, by
stage, and where a comparison's reported runs head for (checked against float64 arithmetic by hand)."""

from __future__ import annotations

import math
import statistics

import pytest

from studies.experiment import Experiment
from studies.pages import write_record
from studies.phenomenon import heading_for, phenomenon_page, stages
from studies.runs import record_path


def test_heading_for_is_the_mean_of_the_arms_means_with_their_standard_errors():
    a, b = [0.20, 0.30, 0.25], [0.40, 0.35, 0.30]
    h = heading_for({"a": a, "b": b}, floor=0.3, planned=50)
    se = math.sqrt(statistics.variance(a) / 3 + statistics.variance(b) / 3) / 2
    assert h["mean"] == pytest.approx(0.30)
    assert h["lo"] == pytest.approx(0.30 - 1.959964 * se, abs=1e-6)
    assert h["hi"] == pytest.approx(0.30 + 1.959964 * se, abs=1e-6)
    assert h["reads"] == "either side of the floor" and h["chance"] == pytest.approx(0.5)
    low = heading_for({"a": [0.10, 0.12], "b": [0.11, 0.13]}, floor=0.3, planned=50)
    assert low["reads"] == "below the floor" and low["chance"] < 1e-6
    high = heading_for({"a": [0.50, 0.52], "b": [0.51, 0.53]}, floor=0.3, planned=50)
    assert high["reads"] == "above the floor" and high["chance"] > 1 - 1e-6
    # the chance widens with the planned runs' own spread: fewer planned runs, a wider predictive spread
    near = {"a": [0.26, 0.30, 0.28], "b": [0.27, 0.31, 0.29]}
    assert heading_for(near, 0.3, planned=3)["chance"] > heading_for(near, 0.3, planned=300)["chance"]
    assert heading_for({"a": [0.3], "b": [0.3, 0.4]}, 0.3, planned=5)["reads"] == "too few runs"


def _record(run, cv: float, heldout: float) -> dict:
    metrics = [
        {"step": i + 1, "generated_tokens": 10.0 * (i + 1), "reward": 0.5, "otb/horizon/length_cv": v}
        for i, v in enumerate((cv - 0.1, cv + 0.1))  # a run's value: the mean over its steps
    ]
    summary = {"held-out reward before": 0.1, "held-out reward after": heldout}
    return {
        "arm": run.arm,
        "seed": run.seed,
        "overrides": run.overrides,
        "metrics": metrics,
        "summary": summary,
    }


def test_the_page_reads_each_stage_at_the_arms_rates_and_no_reward(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # run folders (none here) are looked for under runs/compare
    exp = Experiment(
        name="t",
        recipe="demo",
        arms={"otb": {"learning_rate": 1e-4}, "grpo": {"learning_rate": 1e-4}},
        seeds=[0, 1],
        smooth=1,
        pilot={"seed": 9, "seeds": [9, 10], "learning_rates": [1e-4, 3e-4], "variance_seeds": [11]},
        comparisons=[
            {"name": "c", "kind": "better", "candidate": "otb", "baseline": "grpo", "budgets": [10]}
        ],
        phenomenon={"length_cv_run": 0.3},
    )
    results = tmp_path / "results"
    cvs = {"otb": {9: 0.21, 10: 0.23, 11: 0.25, 0: 0.27}, "grpo": {9: 0.31, 10: 0.33, 11: 0.35, 0: 0.37}}
    for stage, runs in stages(exp).items():
        folder = results / "runs" / ("t" if stage == "reported runs" else "t-pilot")
        for run in runs:
            arm, _, rate = run.arm.partition("@")
            if run.seed == 1:
                continue  # the reported seed still to run
            cv = 0.9 if rate == "0.0003" else cvs[arm][run.seed]  # the rate not picked must not count
            write_record(record_path(folder, run.arm, run.seed), _record(run, cv, heldout=0.777))
    page = phenomenon_page(exp, results)
    otb = next(line for line in page.splitlines() if line.startswith("| otb |"))
    assert "| 0.220 [" in otb and "(SD 0.014, n=2)" in otb  # first stage: 0.21, 0.23
    assert "| 0.250 (n=1) | 0.270 (n=1) |" in otb  # variance seed 11, reported seed 0
    assert f"{statistics.fmean([0.21, 0.23, 0.25, 0.27]):.3f} [" in otb.split("|")[-2]
    h = heading_for({"otb": [0.21, 0.23, 0.25, 0.27], "grpo": [0.31, 0.33, 0.35, 0.37]}, 0.3, planned=2)
    row = next(line for line in page.splitlines() if line.startswith("| c |"))
    assert f"{h['mean']:.3f} [{h['lo']:.3f}, {h['hi']:.3f}]" in row and "otb (4 runs) + grpo (4 runs)" in row
    assert "0.777" not in page and "0.9" not in page

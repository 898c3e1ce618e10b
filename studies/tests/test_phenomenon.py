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


def test_heading_for_weighs_each_arm_by_its_planned_runs_with_a_t_interval():
    # no shared seed: var of the heading = 1/4 (0.0025 / 3 + 0.0025 / 3); t(0.975, 2) = 4.302653
    a, b = {1: 0.20, 2: 0.30, 3: 0.25}, {4: 0.40, 5: 0.35, 6: 0.30}
    h = heading_for({"a": a, "b": b}, {}, {"a": [10, 11], "b": [10, 11]}, floor=0.3)
    assert h["mean"] == pytest.approx(0.30)
    assert h["hi"] - h["mean"] == pytest.approx(4.302653 * 0.0204124, rel=1e-5)
    assert h["reads"] == "either side of the floor" and h["chance"] == pytest.approx(0.5)
    assert math.isnan(h["now"])  # no reported run yet
    # the same seeds, perfectly correlated: cov of the means 0.1 * 0.1 * 3 / 9; se = sqrt(0.01 / 3)
    a, b = {1: 0.2, 2: 0.3, 3: 0.4}, {1: 0.3, 2: 0.4, 3: 0.5}
    h = heading_for({"a": a, "b": b}, {}, {"a": [10], "b": [10]}, floor=0.3)
    assert h["hi"] - h["mean"] == pytest.approx(4.302653 * 0.0577350, rel=1e-5)
    low = heading_for({"a": {1: 0.10, 2: 0.12}, "b": {1: 0.11, 2: 0.13}}, {}, {"a": [0], "b": [0]}, 0.3)
    assert low["reads"] == "below the floor" and low["chance"] < 1e-6
    assert heading_for({"a": {1: 0.3}, "b": {1: 0.3, 2: 0.4}}, {}, {"a": [0], "b": [0]}, 0.3)["reads"] == (
        "too few runs"
    )


def test_a_finished_plan_reads_what_the_rule_reads_whatever_the_seed_counts():
    """smollm2's shape: 8 planned runs of one arm, 3 of the other, all done: the chance is 0 or 1 and `now`
    is the rule's mean over every run of both arms, (8 x 0.35 + 3 x 0.29) / 11, not the mean of means."""
    a = dict(zip(range(8), [0.33, 0.37] * 4, strict=True))
    b = {0: 0.28, 1: 0.29, 2: 0.30}
    h = heading_for({"a": a, "b": b}, {"a": a, "b": b}, {"a": list(range(8)), "b": [0, 1, 2]}, floor=0.3)
    assert h["now"] == pytest.approx((8 * 0.35 + 3 * 0.29) / 11)
    assert h["mean"] == pytest.approx((8 * 0.35 + 3 * 0.29) / 11)  # the weights are the planned runs
    assert h["chance"] == 1.0
    h = heading_for({"a": a, "b": b}, {"a": a, "b": b}, {"a": list(range(8)), "b": [0, 1, 2]}, floor=0.34)
    assert h["chance"] == 0.0
    # one run still to come: the chance is no longer 0 or 1, and fewer runs to come leave it nearer
    part = {k: v for k, v in a.items() if k != 7}
    one = heading_for({"a": a, "b": b}, {"a": part, "b": b}, {"a": list(range(8)), "b": [0, 1, 2]}, 0.34)
    none = heading_for({"a": a, "b": b}, {}, {"a": list(range(8)), "b": [0, 1, 2]}, 0.34)
    assert 0.0 < one["chance"] < none["chance"] < 0.5


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
    row = next(line for line in page.splitlines() if line.startswith("| c |"))
    assert "otb (4 runs, 2 planned) + grpo (4 runs, 2 planned)" in row
    assert "| 0.320 (2 runs) | 0.320 |" in row  # the rule on the reported runs so far: seed 0's 0.27 and 0.37
    # (and their 4 steps pooled, equal step counts: the same)
    values = {a: dict(zip((9, 10, 11, 0), cvs[a].values(), strict=True)) for a in cvs}
    h = heading_for(values, {"otb": {0: 0.27}, "grpo": {0: 0.37}}, {"otb": [0, 1], "grpo": [0, 1]}, 0.3)
    assert f"{h['mean']:.3f} [{h['lo']:.3f}, {h['hi']:.3f}]" in row
    assert "ran the reported runs' setting" in page
    assert "0.777" not in page and "0.9" not in page

    # without a pilot: the reported runs alone, and the page says so
    alone = Experiment(**{**exp.__dict__, "name": "t", "pilot": None})
    page = phenomenon_page(alone, results)
    assert "has no pilot" in page and "pilot, first stage" not in page and "| 0.270 (n=1) |" in page


def test_the_steps_pooled_weigh_a_longer_run_more_than_the_rules_mean_of_run_means():
    """The column beside the rule: every step of the runs weighs alike. A run of 3 steps at 0.2 and one
    of 1 step at 0.4 read 0.3 by the rule (mean of run means) and 0.25 pooled over their steps."""
    from studies.phenomenon import pooled_over_steps, step_values

    def rows(values):
        return [{"step": i, "reward": 0.5, "otb/horizon/length_cv": v} for i, v in enumerate(values)]

    long, short = rows([0.2, 0.2, 0.2]), rows([0.4])
    short.append({"step": 9, "otb/horizon/length_cv": 0.9})  # no reward: a step analyse_rows skips
    short.append({"step": 10, "reward": 0.5, "otb/horizon/length_cv": float("nan")})
    runs = [{"length_cv_run steps": step_values(m, "length_cv_run")} for m in (long, short)]
    assert runs[1]["length_cv_run steps"] == [0.4]
    assert pooled_over_steps(runs, "length_cv_run") == pytest.approx(0.25)
    assert step_values(long, "energy_cv") == [] and math.isnan(pooled_over_steps([], "length_cv_run"))

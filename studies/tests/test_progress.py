"""`python -m studies progress`: a run's spending (steps, tokens, time, checkpoint) and nothing of its
results, so whoever trains a share can watch it without seeing interim numbers."""

from __future__ import annotations

import json

import pytest

from studies.cli import main
from studies.experiment import load_experiment, plan
from studies.pages import write_record
from studies.progress import last_logged, progress, run_progress
from studies.runs import record_path

EXPERIMENT = """
recipe: smollm2-draws
common: {model: "random:tiny", max_generated_tokens: 2000, max_steps: 50}
arms: {otb: {advantage_estimator: otb}, grpo: {advantage_estimator: grpo}}
seeds: [0, 1, 2]
"""

# rewards chosen to be recognisable anywhere in the output
STEP = {"reward": 0.8123, "heldout_reward": 0.6789, "grad_norm": 4.5678, "reward_std": 0.3141}


@pytest.fixture
def setup(tmp_path):
    spec = tmp_path / "tiny.yaml"
    spec.write_text(EXPERIMENT)
    runs_dir, results = tmp_path / "runs", tmp_path / "results"
    otb0, grpo0, otb1, grpo1, *_ = plan(load_experiment(str(spec)), runs_dir)
    # seed 0: otb recorded, grpo in flight (a checkpoint, two steps, a torn last line)
    write_record(record_path(results / "runs" / "tiny", otb0.arm, 0), {"overrides": otb0.overrides})
    otb0.dir.mkdir(parents=True)  # a folder left behind by the recorded run
    grpo0.dir.mkdir(parents=True)
    (grpo0.dir / "checkpoint-4").mkdir()
    (grpo0.dir / "checkpoint-12").mkdir()
    steps = [
        {**STEP, "step": 1, "generated_tokens": 150.0, "train_seconds": 60.0},
        {"heldout_reward": 0.2222, "step": 1},  # an evaluation row: no generated_tokens
        {**STEP, "step": 13, "generated_tokens": 1500.0, "train_seconds": 1200.0},
    ]
    text = "".join(json.dumps(r) + "\n" for r in steps) + '{"step": 14, "generated_tok'
    (grpo0.dir / "metrics.jsonl").write_text(text)
    (grpo0.dir / "started.json").write_text(json.dumps({"attempt_started": "2026-12-07T14:00:51+00:00"}))
    # seed 1: otb started, still in its step-0 evaluation (no metrics yet)
    otb1.dir.mkdir(parents=True)
    return spec, runs_dir, results


def test_last_logged_keeps_only_spending(tmp_path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    assert last_logged(metrics) == {}
    metrics.write_text(json.dumps({**STEP, "step": 3, "generated_tokens": 90, "train_seconds": 7.5}) + "\n")
    assert last_logged(metrics) == {"step": 3, "generated_tokens": 90, "train_seconds": 7.5}


def test_default_shows_started_runs_without_a_record(setup) -> None:
    spec, runs_dir, results = setup
    rows, recorded, planned = progress(str(spec), runs_dir=runs_dir, results=results)
    assert (recorded, planned) == (1, 6)
    assert [(r["arm"], r["seed"], r["state"]) for r in rows] == [
        ("grpo", 0, "started"),
        ("otb", 1, "started"),
    ]
    grpo = rows[0]
    assert (grpo["step"], grpo["generated_tokens"], grpo["train_seconds"]) == (13, 1500.0, 1200.0)
    assert grpo["checkpoint"] == 12 and grpo["budget"] == 2000
    assert grpo["attempt_started"] == "2026-12-07T14:00:51+00:00"
    assert not set(grpo) & set(STEP)
    assert "step" not in rows[1] and rows[1]["checkpoint"] is None


def test_seeds_show_every_run_of_them(setup) -> None:
    spec, runs_dir, results = setup
    rows, *_ = progress(str(spec), [0, 2], runs_dir=runs_dir, results=results)
    states = {(r["arm"], r["seed"]): r["state"] for r in rows}
    assert states == {
        ("otb", 0): "recorded",
        ("grpo", 0): "started",
        ("otb", 2): "not started",
        ("grpo", 2): "not started",
    }
    with pytest.raises(ValueError, match=r"seeds \[7\] are not among its seeds"):
        progress(str(spec), [7], runs_dir=runs_dir, results=results)


def test_a_finished_run_without_its_record_says_so(setup) -> None:
    spec, runs_dir, results = setup
    run = plan(load_experiment(str(spec)), runs_dir)[1]  # grpo seed 0
    (run.dir / "summary.json").write_text("{}")
    (run.dir / "run.json").write_text(json.dumps(run.overrides))
    assert run_progress(run, results / "runs" / "tiny")["state"] == "finished, not recorded"


def test_the_command_prints_spending_and_no_result(setup, capsys) -> None:
    spec, runs_dir, results = setup
    main(["progress", str(spec), "--runs-dir", str(runs_dir), "--results", str(results), "--seeds", "0-1"])
    out = capsys.readouterr().out
    assert "tiny: 1 of 6 runs recorded" in out
    assert "1,500 of 2,000 (75%)" in out and "20 min" in out
    for value in (*STEP.values(), 0.2222):
        assert str(value) not in out and f"{value:.2f}" not in out
    with pytest.raises(SystemExit):
        main(["progress", str(spec), "--seeds", "9", "--runs-dir", str(runs_dir)])
    assert "not among its seeds" in capsys.readouterr().err

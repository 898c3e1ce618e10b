"""`python -m studies compare`: the analysis on synthetic runs with known answers, experiment-file
errors, and every packaged experiment's --quick mode end to end (what CI runs to keep the code path alive)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytest.importorskip("otbrl.integrations.trl")

from otbrl.app.metrics import append_metrics, moving_average, read_metrics, write_metrics  # noqa: E402
from studies.compare import compare, pilot  # noqa: E402
from studies.compare_page import (  # noqa: E402
    busy_seconds,
    comparisons_table,
    cost_table,
    events,
    machine_splits,
    table,
)
from studies.experiment import (  # noqa: E402
    Experiment,
    experiment_names,
    load_experiment,
    pilot_plan,
    plan,
)
from studies.outcomes import analyse, collapse_step, surge_steps, wall_seconds  # noqa: E402
from studies.pages import markdown_table  # noqa: E402
from studies.pilot import picks_and_gate, pilot_grids, pilot_page  # noqa: E402
from studies.runs import Run  # noqa: E402


def test_centred_average_has_no_lag() -> None:
    assert moving_average([0, 0, 0, 1, 1, 1], 3) == [0, 0, 1 / 3, 2 / 3, 1, 1]
    assert moving_average([1.0, 2.0], 1) == [1.0, 2.0]
    step = [0.0] * 10 + [1.0] * 10
    smooth = moving_average(step, 5)
    assert smooth.index(next(v for v in smooth if v >= 0.5)) == 10  # crosses 0.5 where the step is


def test_trailing_moving_average_against_a_plain_loop() -> None:
    values = [0.3, 1.0, -2.0, 4.5, 0.0, 7.25, 1.0]
    for window in (1, 2, 3, 10):
        want = []
        for i in range(len(values)):
            total, count = 0.0, 0
            for j in range(i - window + 1, i + 1):
                if j >= 0:
                    total, count = total + values[j], count + 1
            want.append(total / count)
        assert moving_average(values, window, centred=False) == pytest.approx(want)
    assert moving_average([], 3) == []
    with pytest.raises(ValueError, match="window"):
        moving_average(values, 0)


def test_metrics_round_trip(tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    write_metrics(path, [{"step": 1, "loss": 0.5}])
    second = {"step": 2, "reward": 0.25, "generated_tokens": 40.0}
    append_metrics(path, second)
    path.write_text(path.read_text() + "\n  \n")  # blank lines (an interrupted write) are skipped
    assert read_metrics(path) == [{"step": 1, "loss": 0.5}, second]
    assert read_metrics(path, "reward") == [second]


def test_markdown_table_compact_and_aligned() -> None:
    assert markdown_table(["a", "bb"], [[1, "x"], ["long", 2]], aligned=False).splitlines() == [
        "| a | bb |",
        "|---|---|",
        "| 1 | x |",
        "| long | 2 |",
    ]
    assert markdown_table(["a", "bb"], [[1, "x"]]).splitlines() == ["| a | bb |", "|--:|---:|", "| 1 |  x |"]
    with pytest.raises(ValueError, match="rows"):
        markdown_table(["a", "b"], [[1]])


def test_collapse_step() -> None:
    steps = list(range(1, 31))
    # starts at 0.5 (mean of the first window of 2), falls to 0.1 at step 11 and stays: collapse at the
    # first step whose trailing mean is below 0.25, if 5 such steps follow inside the run
    falls = [0.5] * 10 + [0.1] * 20
    assert collapse_step(steps, falls, window=2, fraction=0.5, hold=5) == 12
    recovers = [0.5] * 10 + [0.1] * 4 + [0.5] * 16
    assert collapse_step(steps, recovers, window=2, fraction=0.5, hold=5) is None
    at_the_end = [0.5] * 27 + [0.0] * 3  # the run ends before the fall has lasted `hold` steps
    assert collapse_step(steps, at_the_end, window=2, fraction=0.5, hold=5) is None
    assert collapse_step(steps, [0.0] * 30, window=2, fraction=0.5, hold=5) is None  # nothing to lose
    assert collapse_step(steps[:5], [0.5] * 5, window=2, fraction=0.5, hold=5) is None  # too short


def test_surges_on_the_smoothed_norm_without_zero_gradient_steps() -> None:
    steps = list(range(1, 61))
    calm = [1.0, 1.2] * 30
    assert surge_steps(steps, calm, factor=3.0) == []
    spiky = list(calm)
    spiky[30] = 40.0  # one step: the 5-step mean jumps to ~9x the median, and stays up 5 steps
    assert surge_steps(steps, spiky, factor=3.0) == [31]  # one surge, not five
    zeros = [0.0 if i % 2 else 1.0 for i in range(60)]  # every other step has no reward spread
    assert surge_steps(steps, zeros, factor=3.0) == []  # a zero never drags the median down
    assert surge_steps(steps, [math.nan] * 60, factor=3.0) == []


def _fake_run(
    root: Path,
    arm: str,
    seed: int,
    rewards: list[float],
    tokens_per_step: float,
    heldout: dict[int, float] | None = None,
    norms: list[float] | None = None,
    prompts: list[str] | None = None,
) -> Run:
    d = root / arm / f"seed{seed}"
    d.mkdir(parents=True)
    lines = []
    for i, r in enumerate(rewards):
        tokens = tokens_per_step * (i + 1)
        row = {
            "step": i + 1,
            "generated_tokens": tokens,
            "reward": r,
            "grad_norm": norms[i] if norms else 1.0,
            "clipped": bool(norms and norms[i] > 1.0),
            "prompts_sha": prompts[i] if prompts else f"p{i}",
            "otb/horizon/length_cv": 0.5,
        }
        due = [b for b in (heldout or {}) if tokens - tokens_per_step < b <= tokens]
        if due:
            row.update(heldout_reward=heldout[due[0]], heldout_budgets=due)
        lines.append(row)
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (d / "summary.json").write_text(
        json.dumps({"held-out reward after": rewards[-1], "held-out reward before": None})
    )
    return Run(arm, seed, d, {})


def test_analysis_on_known_runs(tmp_path) -> None:
    comparisons = [
        {"name": "c", "kind": "better", "candidate": "otb", "baseline": "grpo", "budgets": [200, 400]},
        {
            "name": "m",
            "kind": "matches",
            "margin": 0.05,
            "candidate": "otb",
            "baseline": "big",
            "budgets": [400],
            "baseline_budgets": [1600],
        },
    ]
    exp = Experiment(
        name="t",
        recipe="demo",
        arms={"otb": {}, "grpo": {}, "big": {}},
        seeds=[0, 1, 2],
        smooth=1,
        thresholds=[0.6],
        comparisons=comparisons,
    )
    rise = [0.2, 0.4, 0.6, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8]
    slow = [0.2, 0.3, 0.4, 0.5, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6]
    runs = []
    for seed, (gain, base) in enumerate([(0.10, 0.30), (0.12, 0.35), (0.14, 0.40)]):
        runs.append(_fake_run(tmp_path, "otb", seed, rise, 100, {200: base + gain, 400: base + 2 * gain}))
        runs.append(_fake_run(tmp_path, "grpo", seed, slow, 100, {200: base, 400: base}))
        runs.append(_fake_run(tmp_path, "big", seed, rise, 400, {400: base, 1600: base + 2 * gain + 0.01}))
    res = analyse(exp, runs)
    otb, grpo = res["arms"]["otb"], res["arms"]["grpo"]
    assert otb["heldout"][200] == pytest.approx([0.40, 0.47, 0.54])
    assert otb["to_threshold"][0.6] == [300, 300, 300] and grpo["to_threshold"][0.6] == [500, 500, 500]
    better, matches = res["comparisons"]
    # held-out @200: differences 0.10, 0.12, 0.14 -> mean 0.12, sd 0.02, t(2) = 4.3027
    ci = better["heldout"][0]["interval"]
    half = 4.302652729911275 * 0.02 / math.sqrt(3)
    assert (ci.mean, ci.lo, ci.hi, ci.n) == pytest.approx((0.12, 0.12 - half, 0.12 + half, 3))
    assert better["heldout"][0]["verdict"] == "held"
    assert better["tokens"][0]["interval"].mean == pytest.approx(200)  # 500 - 300 in every seed
    assert better["tokens"][0]["verdict"] == "held"  # the same saving in every seed: a zero-width interval
    assert better["verdict"] == "held"
    assert matches["heldout"][0]["baseline_budget"] == 1600
    assert matches["heldout"][0]["interval"].mean == pytest.approx(-0.01)
    assert matches["verdict"] == "held"  # -0.01 exactly in every seed: the interval is above -0.05
    assert res["prompt_problems"] == []
    assert otb["length_cv_start"] == [0.5, 0.5, 0.5]  # the trainer's otb/horizon/length_cv, first steps
    text = table(exp, res)
    assert "| otb | 3 |" in text and "300.000 ± 0.000 (3/3)" in text
    assert "held-out reward @0.4k vs 1.6k" in comparisons_table(res)


def test_prompt_check_finds_arms_that_saw_different_prompts(tmp_path) -> None:
    exp = Experiment(name="t", recipe="demo", arms={"a": {}, "b": {}}, seeds=[0], smooth=1)
    runs = [
        _fake_run(tmp_path, "a", 0, [0.1] * 4, 10, prompts=["x", "y", "z", "w"]),
        _fake_run(tmp_path, "b", 0, [0.1] * 4, 10, prompts=["x", "y", "q", "w"]),
    ]
    assert analyse(exp, runs)["prompt_problems"] == ["seed 0: b and a differ at 1 steps (first 3)"]


def test_prompt_check_compares_only_arms_that_draw_as_many_prompts_a_step(tmp_path) -> None:
    # 64 samples a step: N=4 draws 16 prompts, N=32 draws 2; only same-size draws must match
    exp = Experiment(name="t", recipe="demo", arms={"a": {}, "b": {}, "big": {}}, seeds=[0], smooth=1)
    runs = [
        _fake_run(tmp_path, "a", 0, [0.1] * 3, 10, prompts=["x", "y", "z"]),
        _fake_run(tmp_path, "b", 0, [0.1] * 3, 10, prompts=["x", "q", "z"]),
        _fake_run(tmp_path, "big", 0, [0.1] * 3, 10, prompts=["u", "v", "w"]),
    ]
    for run, n in zip(runs, (4, 4, 32), strict=True):
        run.overrides.update(num_generations=n, per_device_train_batch_size=64)
    assert analyse(exp, runs)["prompt_problems"] == ["seed 0: b and a differ at 1 steps (first 2)"]
    runs[1].overrides.update(num_generations=32)  # now b draws 2 prompts a step, like big
    assert analyse(exp, runs)["prompt_problems"] == ["seed 0: big and b differ at 3 steps (first 1)"]


def test_a_collapse_and_a_surge_are_reported_by_run(tmp_path) -> None:
    exp = Experiment(name="t", recipe="demo", arms={"bad": {}}, seeds=[0], smooth=2, collapse_steps=5)
    norms = [1.0] * 12 + [50.0] + [1.0] * 17
    run = _fake_run(tmp_path, "bad", 0, [0.5] * 14 + [0.0] * 16, 10, norms=norms)
    res = analyse(exp, [run])
    assert res["runs"]["bad"][0]["collapse"] == 16 and res["runs"]["bad"][0]["surges"] == [13]
    assert res["arms"]["bad"]["clip_fraction"] == [pytest.approx(1 / 30)]
    assert events(res).splitlines()[2:] == ["| bad | 0 | 13 | — | 16 |"]


def test_cost_per_run_by_machine_from_the_records_stamps() -> None:
    stamps = {"started": "2026-11-27T10:00:00+00:00", "finished": "2026-11-27T10:30:30+00:00"}
    assert wall_seconds(stamps) == 1830.0
    assert math.isnan(wall_seconds({"started": stamps["started"]}))  # an unfinished stamp: unknown
    assert math.isnan(wall_seconds({"started": "yesterday", "finished": stamps["finished"]}))
    # a run started again: its wall time is the attempt that finished, not the time since its first start
    assert wall_seconds({**stamps, "attempt_started": "2026-11-27T10:20:30+00:00"}) == 600.0

    def run(where: str, wall: float, train: float) -> dict:
        return {"where": where, "wall_seconds": wall, "train_seconds": train}

    result = {
        "runs": {
            "otb-N4": [run("cpu A", 1200.0, 600.0), run("gpu B", 300.0, 120.0), run("cpu A", 1800.0, 900.0)],
            "grpo-N4": [run("cpu A", 3600.0, 1500.0), run("gpu B", math.nan, 100.0)],
        }
    }
    text = cost_table(result)
    # cpu A: walls 20, 30, 60 min -> median 30 (2 runs an hour); trains 10, 15, 25 -> 15. gpu B: the one
    # run with a stamp (5 min, 12 an hour); its training median counts that run only. Neither label names
    # a CPU count, so the machine's rate is not guessed
    assert "| cpu A | 3 | 30.0 | 15.0 | 2.00 | — |" in text  # no record spans: not how they ran
    assert "| gpu B | 1 | 5.0 | 2.0 | 12.00 | — |" in text
    # as they ran: two side by side from 0 to 60 min, a third from 30 to 90, a gap, a fourth from 120 to
    # 180 -> busy 150 min for 4 runs (1.60 an hour), where one process finishes 1.00 an hour
    spans = [(0, 3600), (0, 3600), (1800, 5400), (7200, 10800)]
    text = cost_table({"runs": {"a": [{**run("cpu C", 3600.0, 3000.0), "span": s} for s in spans]}})
    assert "| cpu C | 4 | 60.0 | 50.0 | 1.00 | 1.60 |" in text
    unnamed = {"runs": {"a": [{**run("not recorded", 3600.0, 3000.0), "span": s} for s in spans]}}
    assert "| not recorded | 4 | 60.0 | 50.0 | 1.00 | — |" in cost_table(unnamed)  # maybe several machines
    assert busy_seconds([]) == 0 and busy_seconds([(5, 10), (6, 7), (0, 1)]) == 6
    assert cost_table({"runs": {"otb-N4": [run("cpu A", math.nan, 5.0)]}}) == ""


def test_experiment_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="no packaged experiment"):
        load_experiment("nope")
    bad = tmp_path / "bad.yaml"
    bad.write_text("recipe: demo\nseeds: [0]\narms: {a: {}}\nsedes: [1]\n")
    with pytest.raises(ValueError, match="unknown key 'sedes'"):
        load_experiment(str(bad))
    bad.write_text("recipe: demo\nseeds: [0]\narms: {a: {}}\nreference: b\n")
    with pytest.raises(ValueError, match="reference 'b' is not an arm"):
        load_experiment(str(bad))
    for roles, message in (
        ("{candidate: b}", "role 'candidate' names 'b', which is not an arm"),
        ("{lr_decay: {a: {length: [a, c]}}}", "role 'lr_decay' names 'c'"),
        ("{reference: a}", "top-level `reference`"),
        ("[a]", "roles must map role names to arms"),
    ):
        bad.write_text(f"recipe: demo\nseeds: [0]\narms: {{a: {{}}}}\nroles: {roles}\n")
        with pytest.raises(ValueError, match=message):
            load_experiment(str(bad))
    bad.write_text("recipe: demo\nseeds: [0]\narms: {a: {learning_rat: 1}}\n")
    with pytest.raises(ValueError, match="learning_rat: not a recipe key"):
        plan(load_experiment(str(bad)), tmp_path)


@pytest.mark.parametrize("name", experiment_names())
def test_packaged_roles_name_arms(name) -> None:
    exp = load_experiment(name)
    bases = {a.rpartition("@")[0] if exp.ladder else a for a in exp.arms}  # a ladder's roles name bases
    assert exp.roles and exp.role("candidate") in bases
    quick = load_experiment(name, quick=True)  # a quick run drops arms; the roles stay as written
    assert quick.roles == exp.roles


def test_plan_keeps_the_prompt_budget_and_each_arms_seeds(tmp_path) -> None:
    exp = load_experiment("walk")
    runs = plan(exp, tmp_path)
    assert len(runs) == 3 * 5 + 3  # N=4 arms on 5 seeds, grpo-N32 on 3
    assert sorted(r.seed for r in runs if r.arm == "grpo-N32") == [0, 1, 2]
    for run in runs:
        n = run.overrides["num_generations"]
        assert run.overrides["per_device_train_batch_size"] == 4 * n
        assert run.overrides["max_generated_tokens"] == (600_000 if n == 32 else 200_000)
        assert "seeds" not in run.overrides and run.overrides["eval_size"] >= 512
        assert run.overrides["output_dir"] == str(tmp_path / run.arm / f"seed{run.seed}")


def test_pilot_runs_every_arm_at_each_rate_on_its_own_seed(tmp_path) -> None:
    exp = load_experiment("walk")
    runs = pilot_plan(exp, tmp_path)
    want = {
        (f"{a}@{lr:g}", lr)
        for a, o in exp.arms.items()
        for lr in o.get("pilot_learning_rates", exp.pilot["learning_rates"])
    }
    assert {(r.arm, r.overrides["learning_rate"]) for r in runs} == want and len(runs) == len(want)
    assert {r.seed for r in runs} == {exp.pilot["seed"]} and exp.pilot["seed"] not in exp.seeds
    factor = exp.pilot["token_factor"]
    for r in runs:  # the pilot's budget is its arm's, scaled; the arm-only keys never reach a recipe
        arm = r.arm.rpartition("@")[0]
        budget = {**exp.common, **exp.arms[arm]}["max_generated_tokens"]
        assert r.overrides["max_generated_tokens"] == round(budget * factor)
        assert not {"seeds", "pilot_learning_rates", "token_factor"} & set(r.overrides)


def test_pilot_page_picks_the_best_rate_per_arm(tmp_path) -> None:
    exp = Experiment(
        name="t",
        recipe="demo",
        arms={"a": {}, "b": {}},
        seeds=[0],
        smooth=1,
        pilot={"seed": 9, "learning_rates": [1e-4, 3e-4]},
    )
    runs = []
    for arm, lr, rewards in [
        ("a", 1e-4, [0.3] * 8),
        ("a", 3e-4, [0.5] * 4 + [0.0] * 4),
        ("b", 1e-4, [0.2] * 8),
        ("b", 3e-4, [0.4] * 8),
    ]:
        run = _fake_run(tmp_path, f"{arm}@{lr:g}", 9, rewards, 10)
        run.overrides["learning_rate"] = lr
        runs.append(run)
    page, picks = pilot_page(exp, runs, tmp_path / "out", "cmd", log=lambda _: None)
    assert picks == {"a": 1e-4, "b": 3e-4}  # a collapsed at 3e-4: the last quarter decides
    assert "| a | 0.300 | 0.000 | 0.0001 |" in page.read_text()


def test_a_fair_pilot_picks_by_held_out_reward_averaged_over_its_seeds(tmp_path) -> None:
    """Issue 33: with `pilot.seeds` and `pick: heldout` every rate runs on every pilot seed and the pick is
    the best mean held-out reward at the end of the budget, not one seed's late train reward."""
    pilot = {
        "seed": 9,
        "seeds": [9, 10, 11],
        "pick": "heldout",
        "learning_rates": [1e-4, 3e-4],
        "gate": {"heldout_gain": 0.05},
    }
    exp = Experiment(name="t", recipe="demo", arms={"a": {}}, seeds=[0], smooth=1, pilot=pilot)
    planned = pilot_plan(exp, tmp_path / "plan")
    assert sorted((r.arm, r.seed) for r in planned) == sorted(
        (f"a@{lr:g}", s) for lr in (1e-4, 3e-4) for s in (9, 10, 11)
    )
    runs = []
    # 3e-4 has the higher train reward on every seed, 1e-4 the higher held-out reward on average
    for lr, train, after in [(1e-4, 0.3, [0.50, 0.40, 0.45]), (3e-4, 0.6, [0.60, 0.30, 0.30])]:
        for seed, a in zip((9, 10, 11), after, strict=True):
            run = _fake_run(tmp_path, f"a@{lr:g}", seed, [train] * 8, 10)
            (run.dir / "summary.json").write_text(
                json.dumps({"held-out reward after": a, "held-out reward before": 0.3})
            )
            run.overrides["learning_rate"] = lr
            runs.append(run)
    page, picks = pilot_page(exp, runs, tmp_path / "out", "cmd", log=lambda _: None)
    assert picks == {"a": 1e-4}  # 0.45 against 0.40; the train reward would have picked 3e-4
    text = page.read_text()
    assert "| a | 0.450 | 0.400 | 0.0001 |" in text and "averaged over these seeds" in text
    assert "| a | 0.0001 | 0.300 | 0.450 | +0.150 |" in text  # the gate reads the mean gain
    with pytest.raises(ValueError, match="hold the pilot seed"):
        bad = tmp_path / "bad.yaml"
        bad.write_text(
            "recipe: demo\nseeds: [0]\narms: {a: {}}\n"
            "pilot: {seed: 9, seeds: [10, 11], learning_rates: [1e-4]}\n"
        )
        load_experiment(str(bad))


def test_a_ladder_puts_every_arm_on_every_rung(tmp_path) -> None:
    path = tmp_path / "l.yaml"
    path.write_text(
        "recipe: demo\nseeds: [0, 1]\nladder: [1.0e-4, 1.0e-3]\nroles: {candidate: a}\n"
        "arms: {a: {}, b: {seeds: [0], ladder: [1.0e-3]}}\n"
    )
    exp = load_experiment(str(path))
    assert {r.arm: r.overrides["learning_rate"] for r in plan(exp, tmp_path)} == {
        "a@0.0001": 1e-4,
        "a@0.001": 1e-3,
        "b@0.001": 1e-3,
    }
    assert exp.arm_seeds("b@0.001") == [0]
    path.write_text("recipe: demo\nseeds: [0]\nladder: [1.0e-4]\narms: {a: {learning_rate: 1}}\n")
    with pytest.raises(ValueError, match="the ladder sets it"):
        load_experiment(str(path))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("arms: {a: {seeds: [7]}}", r"seeds \[7\] are not all among"),
        ("arms: {a: {}}\ncomparisons: [{name: c, candidate: a, baseline: z}]", "'z' is not an arm"),
        ("arms: {a: {}}\ncomparisons: [{candidate: a, baseline: a}]", "needs 'name'"),
        ("arms: {a: {}}\npilot: {seed: 0, learning_rates: [1.0e-4]}", "pilot seed 0 is also a reported"),
        ("arms: {a: {}}\npilot: {seed: 9}", "pilot needs a seed and learning_rates"),
        ("arms: {a: {}}\nconfidence: 95", "confidence must be in"),
    ],
)
def test_protocol_errors(tmp_path, extra, message) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(f"recipe: demo\nseeds: [0]\n{extra}\n")
    with pytest.raises(ValueError, match=message):
        load_experiment(str(path))


@pytest.mark.parametrize("name", experiment_names())
def test_quick_mode_end_to_end(tmp_path, name) -> None:
    lines: list[str] = []
    exp = load_experiment(name, quick=True)
    rows = lambda: [ln for ln in lines if any(f"| {arm} |" in ln for arm in exp.arms)]  # noqa: E731
    if name == experiment_names()[0]:  # a share of the plan: whoever runs it is not shown the interim numbers
        compare(
            name,
            quick=True,
            jobs=2,
            runs_dir=tmp_path / "share",
            results=tmp_path / "share-out",
            log=lines.append,
            arms=[next(iter(exp.arms))],
        )
        assert f"1 of {len(exp.arms) * len(exp.seeds)} runs recorded; the interim page is" in lines[-1]
        assert rows() == []
    page, failures = compare(
        name, quick=True, jobs=2, runs_dir=tmp_path / "runs", results=tmp_path / "out", log=lines.append
    )
    assert failures == []
    assert len(rows()) == 1  # the whole plan recorded: the per-arm table is printed
    text = page.read_text()
    for arm in exp.arms:
        assert f"| {arm} | {len(exp.seeds)} |" in text
    assert (tmp_path / "out" / f"{name}.png").stat().st_size > 10_000
    numbers = json.loads((tmp_path / "out" / f"{name}.json").read_text())
    for stats in numbers["arms"].values():
        assert all(math.isfinite(x) for x in stats["final"] + stats["held_out"])
        assert all(t > 0 for t in stats["total_tokens"])
    assert numbers["prompt_problems"] == []  # every arm of the seed saw the same prompts
    assert "Cost per run" in text  # every record stamps its start and finish
    for what, why in exp.dropped.items():  # what the protocol left out of its claims, with its reason
        assert f"- {what}: {why}" in text
    if exp.same_machine:  # one machine trained every arm here
        assert "checked from the records, every seed's arms trained on one machine." in text
    starts = {json.dumps(stats["heldout"].get("0")) for stats in numbers["arms"].values()}
    shared = list((tmp_path / "runs" / ".heldout-before").glob("*.json"))
    if exp.common.get("eval_before", True) and "0" in next(iter(numbers["arms"].values()))["heldout"]:
        # one model, prompts and seed: one step-0 score, computed once (or by both runs of a race)
        assert len(starts) == 1 and len(shared) == 1
    else:
        assert shared == []
    if name == experiment_names()[0]:  # resuming: finished runs are kept, not redone
        compare(
            name, quick=True, jobs=2, runs_dir=tmp_path / "runs", results=tmp_path / "out", log=lines.append
        )
        assert any("already done" in line for line in lines)


@pytest.mark.parametrize("name", experiment_names())
def test_quick_settings_win_over_each_arms_own(tmp_path, name) -> None:
    """--quick is a smoke run: an arm's own budget (grpo-N32's 600k tokens in walk) must not undo it."""
    quick = load_experiment(name, quick=True)
    forced = quick.forced
    assert forced, f"{name}: its quick section changes nothing"
    for run in plan(quick, tmp_path):
        for key, value in forced.items():
            assert run.overrides[key] == value, (run.arm, key)


def test_ladder_figure_has_a_column_per_rung_and_marks_events(monkeypatch, tmp_path) -> None:
    """Every seed of every arm is drawn in its rung's column, with its collapse (x) and LR-decay (v)."""
    from studies import outcomes as ladder

    figures = []
    monkeypatch.setattr(ladder, "save", lambda fig, path, **kw: figures.append(fig))

    def run(seed, collapse=None, decays=()):  # noqa: ANN001, ANN202
        steps = list(range(1, 21))
        return {
            "seed": seed,
            "steps": steps,
            "smooth": [0.3] * 20,
            "length": [80.0] * 20,
            "collapse": collapse,
            "decays": list(decays),
        }

    runs = {
        "a@0.0001": [run(0), run(1)],
        "a@0.0004": [run(0, collapse=12), run(1)],
        "b@0.0004": [run(0, decays=[7])],
    }
    ladder.plot_ladder_runs(runs, tmp_path / "x.png", "t", "128 samples")
    (fig,) = figures
    axes = fig.axes
    assert [ax.get_title() for ax in axes[:2]] == ["learning rate 0.0001", "learning rate 0.0004"]
    reward_top_right, length_bottom_right = axes[1], axes[3]
    marks = lambda ax, m: [ln for ln in ax.lines if ln.get_marker() == m and len(ln.get_xdata()) == 1]  # noqa: E731
    assert [ln.get_xdata()[0] for ln in marks(reward_top_right, "x")] == [12]
    assert [ln.get_xdata()[0] for ln in marks(length_bottom_right, "v")] == [7]
    # a's two seeds and its mean in the left reward panel; the mean is labelled with n
    assert len(axes[0].lines) == 3 and axes[0].lines[-1].get_label() == "a (n=2)"


def test_a_matches_claim_that_a_same_n_baseline_passes_too_is_not_discriminating(tmp_path) -> None:
    """Issue 33's rule: OTB matching the large group is informative only if the same-N baselines do
    not; a baseline that passes the same test makes the claim "not discriminating", named."""
    spec = {
        "name": "m",
        "kind": "matches",
        "margin": 0.05,
        "candidate": "otb",
        "baseline": "big",
        "budgets": [400],
        "baseline_budgets": [1600],
        "primary": 400,
    }
    flat = [0.5] * 10
    for strong_grpo, expected in ((True, "not discriminating"), (False, "held")):
        root = tmp_path / str(strong_grpo)
        exp = Experiment(
            name="t",
            recipe="demo",
            arms={"otb": {}, "grpo": {}, "big": {}},
            seeds=[0, 1, 2],
            smooth=1,
            comparisons=[spec],
            roles={"candidate": "otb", "same_n_baseline": ["grpo"]},
        )
        runs = []
        for seed, base in enumerate([0.30, 0.35, 0.40]):
            runs.append(_fake_run(root, "otb", seed, flat, 100, {400: base - 0.01}))
            grpo = base - (0.02 if strong_grpo else 0.2 + 0.01 * seed)
            runs.append(_fake_run(root, "grpo", seed, flat, 100, {400: grpo}))
            runs.append(_fake_run(root, "big", seed, flat, 400, {1600: base}))
        (c,) = analyse(exp, runs)["comparisons"]
        assert c["heldout"][0]["verdict"] == "held"  # OTB alone passes in both cases
        (control,) = c["controls"]
        assert control["arm"] == "grpo" and control["verdict"] == ("held" if strong_grpo else "did not hold")
        assert c["verdict"] == expected
        text = comparisons_table({"comparisons": [c]})
        assert "same-N control: held-out reward @0.4k vs 1.6k, grpo − big" in text
        assert ("not discriminating: grpo passes too" in text) == strong_grpo


def test_heldout_auc_is_the_mean_of_the_curve_and_a_registered_secondary(tmp_path) -> None:
    from studies.outcomes import heldout_auc

    # trapezoids: 0..100 at (0.2+0.4)/2, 100..400 at (0.4+0.6)/2 -> (30 + 150) / 400
    assert heldout_auc({0: 0.2, 100: 0.4, 400: 0.6}, [100, 400]) == pytest.approx(0.45)
    assert heldout_auc({100: 0.4, 400: 0.6}, [100, 400]) is None  # no step-0 score: no area
    spec = {
        "name": "c",
        "kind": "better",
        "candidate": "otb",
        "baseline": "grpo",
        "budgets": [200, 400],
        "primary": 400,
        "secondary": ["auc"],
    }
    exp = Experiment(
        name="t", recipe="demo", arms={"otb": {}, "grpo": {}}, seeds=[0, 1, 2], smooth=1, comparisons=[spec]
    )
    runs = []
    for seed, gain in enumerate([0.05, 0.06, 0.07]):
        for arm, g in (("otb", gain), ("grpo", 0.0)):
            r = _fake_run(tmp_path, arm, seed, [0.5] * 8, 100, {200: 0.3 + g, 400: 0.4 + g})
            summary = json.loads((r.dir / "summary.json").read_text())
            (r.dir / "summary.json").write_text(json.dumps({**summary, "held-out reward before": 0.2}))
            runs.append(r)
    (c,) = analyse(exp, runs)["comparisons"]
    # otb - grpo AUC = (200 * g / 2 + 200 * (2 g) / 2) / 400 = 0.75 g
    assert c["auc"]["interval"].mean == pytest.approx(0.75 * 0.06)
    assert c["auc"]["verdict"] == "held"
    assert "held-out AUC (mean held-out reward from step 0 to 0.4k)" in comparisons_table(
        {"comparisons": [c]}
    )


def test_the_pilot_gate_can_ask_for_the_gap_claim_b_needs(tmp_path) -> None:
    """Issue 33, item 3: `gate: {gap: {larger, smaller, margin}}` passes only when the larger group's
    held-out reward at the end of its budget (at its pick, over the pilot seeds) beats the smaller
    group's by the margin; a gap too small closes the gate, and a bad gap is refused at load time."""

    def pilot_of(larger_after: list[float]) -> tuple[bool, str]:
        gate = {"heldout_gain": 0.0, "gap": {"larger": "big", "smaller": "small", "margin": 0.03}}
        pilot = {"seed": 9, "seeds": [9, 10], "pick": "heldout", "learning_rates": [1e-4], "gate": gate}
        exp = Experiment(
            name="t", recipe="demo", arms={"big": {}, "small": {}}, seeds=[0], smooth=1, pilot=pilot
        )
        runs = []
        for arm, after in (("big", larger_after), ("small", [0.40, 0.42])):
            for seed, a in zip((9, 10), after, strict=True):
                run = _fake_run(tmp_path / str(larger_after), f"{arm}@0.0001", seed, [0.3] * 8, 10)
                (run.dir / "summary.json").write_text(
                    json.dumps({"held-out reward after": a, "held-out reward before": 0.3})
                )
                run.overrides["learning_rate"] = 1e-4
                runs.append(run)
        _, _, rows, ok = picks_and_gate(exp, runs, None)
        return ok, str(rows[-1])

    ok, row = pilot_of([0.46, 0.48])  # 0.47 against 0.41: +0.06
    assert ok and "gap: big − small" in row and "+0.060" in row and "passed" in row
    ok, row = pilot_of([0.42, 0.43])  # +0.015 < 0.03
    assert not ok and "failed" in row

    # the gap's arms alone (`--pilot --arms`): the gap is decided while another arm is still pending
    gate = {"heldout_gain": 0.0, "gap": {"larger": "big", "smaller": "small", "margin": 0.03}}
    one_seed = {"seed": 9, "seeds": [9], "pick": "heldout", "learning_rates": [1e-4], "gate": gate}
    exp = Experiment(
        name="t", recipe="demo", arms={"big": {}, "small": {}, "otb": {}}, seeds=[0], smooth=1, pilot=one_seed
    )
    runs = []
    for arm, after in (("big", 0.42), ("small", 0.41), ("otb", None)):
        run = _fake_run(tmp_path / "share", f"{arm}@0.0001", 9, [0.3] * 8, 10)
        run.overrides["learning_rate"] = 1e-4
        if after is None:
            (run.dir / "summary.json").unlink(missing_ok=True)  # not run yet
        else:
            (run.dir / "summary.json").write_text(
                json.dumps({"held-out reward after": after, "held-out reward before": 0.3})
            )
        runs.append(run)
    _, _, rows, ok = picks_and_gate(exp, runs, None)
    assert not ok and "pending" in str(rows[2]) and "failed" in str(rows[-1]) and "+0.010" in str(rows[-1])
    with pytest.raises(ValueError, match="not among its arms"):
        pilot("walk4", arms=["nope"], runs_dir=tmp_path / "p", results=tmp_path / "r")
    bad = tmp_path / "gap.yaml"
    bad.write_text(
        "recipe: demo\nseeds: [0]\narms: {a: {}}\n"
        "pilot: {seed: 9, learning_rates: [1e-4],\n"
        "        gate: {heldout_gain: 0.05, gap: {larger: z, smaller: a, margin: 0.03}}}\n"
    )
    with pytest.raises(ValueError, match="gap larger"):
        load_experiment(str(bad))


def test_the_pilot_gate_can_ask_for_the_phenomenon_over_whole_runs_at_the_picks(tmp_path) -> None:
    """`gate: {phenomenon: true}`: each comparison's floors (length_cv_run >= 0.3) read over its two arms'
    first-stage runs at their picks, by the reported runs' rule (the mean over both arms' runs of each
    run's mean over its steps). A rate that was not picked does not count; a run still to go keeps the
    row pending; the floor without a protocol phenomenon is refused at load time."""

    def pilot_of(cvs: dict[tuple[str, float], list[float | None]], root: Path) -> tuple[bool, list[str]]:
        spec = {"name": "c", "kind": "better", "candidate": "otb", "baseline": "grpo", "budgets": [10]}
        gate = {"heldout_gain": 0.0, "phenomenon": True}
        pilot_ = {
            "seed": 9,
            "seeds": [9, 10],
            "pick": "heldout",
            "learning_rates": [1e-4, 3e-4],
            "gate": gate,
        }
        exp = Experiment(
            name="t",
            recipe="demo",
            arms={"otb": {}, "grpo": {}},
            seeds=[0],
            smooth=1,
            pilot=pilot_,
            comparisons=[spec],
            phenomenon={"length_cv_run": 0.3},
        )
        runs = []
        for (arm, lr), per_seed in cvs.items():
            for seed, cv in zip((9, 10), per_seed, strict=True):
                run = _fake_run(root, f"{arm}@{lr:g}", seed, [0.3] * 4, 10)
                rows = [json.loads(x) for x in (run.dir / "metrics.jsonl").read_text().splitlines()]
                c = 0.0 if cv is None else cv
                steps = [c - 0.1, c + 0.1, c - 0.05, c + 0.05]  # a run's value: the mean of its steps
                for row, value in zip(rows, steps, strict=True):
                    row["otb/horizon/length_cv"] = value
                (run.dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
                after = 0.5 if lr == 1e-4 else 0.4  # 1e-4 is every arm's pick
                (run.dir / "summary.json").write_text(
                    json.dumps({"held-out reward after": after, "held-out reward before": 0.3})
                )
                run.overrides["learning_rate"] = lr
                runs.append(run)
                if cv is None:  # still to run
                    (run.dir / "summary.json").unlink()
        _, _, rows, ok = picks_and_gate(exp, runs, None)
        return ok, [str(r) for r in rows if str(r).startswith("['phenomenon: ")]

    # at the picks: otb 0.26, grpo 0.31: 0.285 over both arms' runs, below the floor; the 3e-4 runs' high
    # CVs would lift it to 0.41 if they counted
    low = {
        ("otb", 1e-4): [0.25, 0.27],
        ("grpo", 1e-4): [0.30, 0.32],
        ("otb", 3e-4): [0.6, 0.6],
        ("grpo", 3e-4): [0.5, 0.5],
    }
    ok, (row,) = pilot_of(low, tmp_path / "low")
    assert not ok and "failed" in row and "phenomenon: otb + grpo" in row
    assert "otb 0.260, grpo 0.310; over both arms' runs 0.285" in row and "length_cv_run ≥ 0.3" in row
    ok, (row,) = pilot_of({**low, ("grpo", 1e-4): [0.40, 0.42]}, tmp_path / "high")  # 0.335
    assert ok and "passed" in row and "over both arms' runs 0.335" in row
    ok, (row,) = pilot_of({**low, ("grpo", 1e-4): [0.30, None]}, tmp_path / "pending")  # a run to go
    assert not ok and "pending" in row
    bad = tmp_path / "phenomenon.yaml"
    bad.write_text(
        "recipe: demo\nseeds: [0]\narms: {a: {}}\n"
        "pilot: {seed: 9, learning_rates: [1e-4], gate: {heldout_gain: 0.05, phenomenon: true}}\n"
    )
    with pytest.raises(ValueError, match="gate phenomenon needs"):
        load_experiment(str(bad))
    unpiloted = tmp_path / "unpiloted.yaml"  # an arm without pilot runs would keep the row pending for good
    unpiloted.write_text(
        "recipe: demo\nseeds: [0]\narms: {a: {}, b: {pilot_learning_rates: []}}\n"
        "comparisons: [{name: c, kind: better, candidate: a, baseline: b, budgets: [10]}]\n"
        "phenomenon: {length_cv_run: 0.3}\n"
        "pilot: {seed: 9, learning_rates: [1e-4], gate: {heldout_gain: 0.05, phenomenon: true}}\n"
    )
    with pytest.raises(ValueError, match="b has none"):
        load_experiment(str(unpiloted))


def test_the_pilot_grids_average_every_pilot_seed_and_say_which_are_still_to_run(tmp_path) -> None:
    """The reading grids follow the rule: each cell is the mean over the pilot's seeds (not one seed's
    run); a rate with some seeds still to run says how many have, with no mean of the first ones."""
    pilot = {"seed": 9, "seeds": [9, 10], "pick": "heldout", "learning_rates": [1e-4, 3e-4]}
    exp = Experiment(name="t", recipe="demo", arms={"a": {}}, seeds=[0], smooth=1, pilot=pilot)
    runs = []
    for lr, afters in ((1e-4, [0.40, 0.50]), (3e-4, [0.60, None])):
        for seed, after in zip((9, 10), afters, strict=True):
            run = _fake_run(tmp_path, f"a@{lr:g}", seed, [0.3] * 4, 10)
            run.overrides["learning_rate"] = lr
            if after is None:
                (run.dir / "summary.json").unlink()
            else:
                (run.dir / "summary.json").write_text(
                    json.dumps({"held-out reward after": after, "held-out reward before": 0.3})
                )
            runs.append(run)
    gains, cvs = pilot_grids(exp, runs, None)
    assert gains == [["a", "+0.150", "1 of 2 seeds run"]]  # (0.10 + 0.20) / 2; not 0.30 from seed 9 alone
    assert cvs == [["a", "0.500", "1 of 2 seeds run"]]
    scores = picks_and_gate(exp, runs, None)[1]
    assert scores == [["a", "0.450", "1 of 2 seeds run", "pending"]]


def test_machine_splits_name_each_seed_whose_arms_trained_apart() -> None:
    def r(seed: int, where: str) -> dict:
        return {"seed": seed, "machine": where}

    result = {"runs": {"otb-N4": [r(0, "cpu X"), r(1, "cpu X")], "grpo-N4": [r(0, "cpu X"), r(1, "gpu Y")]}}
    assert machine_splits(result) == ["seed 1: otb-N4 on cpu X, grpo-N4 on gpu Y"]
    result["runs"]["grpo-N4"][1]["machine"] = "cpu X"
    assert machine_splits(result) == []


def test_the_pages_machine_checks_read_the_kind_same_machine_enforces(tmp_path) -> None:
    """The page's whole-seed check and its by-machine table group runs by `machine_kind`, the key that
    same_machine refuses on: a seed's arms on two machines of one kind that differ only in core count
    trained in one place; arms whose transformers differ did not, though their labels (device, CPUs,
    torch) read alike, and the page names the key that tells them apart."""
    from studies.compare_page import where_table
    from studies.pages import write_record
    from studies.runs import record_path

    spec = {"name": "c", "kind": "better", "candidate": "a", "baseline": "b", "budgets": [200]}
    exp = Experiment(
        name="t", recipe="demo", arms={"a": {}, "b": {}}, seeds=[0, 1], smooth=1, comparisons=[spec]
    )
    one = {"device": "cpu", "cpus": 2, "machine": "x86_64", "torch": "2.13.0", "transformers": "5.23.0"}
    records = tmp_path / "records"

    def read(envs: dict) -> dict:
        runs = []
        for (arm, seed), env in envs.items():
            run = _fake_run(
                tmp_path / str(len(list(tmp_path.iterdir()))), arm, seed, [0.3] * 3, 100, {200: 0.3}
            )
            rows = read_metrics(run.dir / "metrics.jsonl")
            write_record(
                record_path(records, arm, seed),
                {"overrides": run.overrides, "metrics": rows, "summary": {}, "environment": env},
            )
            runs.append(run)
        return analyse(exp, runs, records)

    cores = read({("a", 0): one, ("b", 0): {**one, "cpus": 4}, ("a", 1): one, ("b", 1): one})
    assert machine_splits(cores) == []
    assert cores["comparisons"][0]["heldout"][0]["by_where"] == []  # one kind: no by-machine table
    versions = read({("a", 0): one, ("b", 0): {**one, "transformers": "5.9.0"}, ("a", 1): one, ("b", 1): one})
    (split,) = machine_splits(versions)
    assert split.startswith("seed 0: a on cpu, 2 CPUs, torch 2.13.0 (transformers")
    assert '"5.9.0"' in split and '"5.23.0"' in split
    assert versions["comparisons"][0]["heldout"][0]["by_where"] != []
    assert "5.9.0" in where_table(versions)


def test_the_pilots_first_stage_may_span_machines_only_where_the_protocol_says(tmp_path, monkeypatch) -> None:
    """`pilot.first_stage_any_machine` (smollm2c's amendment 3) lifts `same_machine` for the first stage
    alone: its pick and gate read arm by arm, while the variance stage's pairs set the power and keep one
    kind of machine a seed. Without the key both stages keep the experiment's rule."""
    import studies.compare as compare_mod

    seen: list[tuple[str, bool]] = []
    monkeypatch.setattr(
        compare_mod,
        "execute",
        lambda label, *a, same_machine=False, **k: seen.append((label, same_machine)) or [],
    )
    monkeypatch.setattr(compare_mod, "picks_and_gate", lambda exp, runs, records: ({"a": 1e-4}, [], [], True))
    yaml = (
        "recipe: demo\nseeds: [0]\nsame_machine: true\narms: {a: {}}\n"
        "pilot: {seed: 9, learning_rates: [1e-4], variance_seeds: [10]%s}\n"
    )
    spec = tmp_path / "anywhere.yaml"
    spec.write_text(yaml % ", first_stage_any_machine: true")
    pilot(str(spec), runs_dir=tmp_path / "p", results=tmp_path / "r", log=lambda _: None)
    assert seen == [("anywhere pilot", False), ("anywhere pilot variance", True)]
    seen.clear()
    spec = tmp_path / "strict.yaml"
    spec.write_text(yaml % "")
    pilot(str(spec), runs_dir=tmp_path / "p2", results=tmp_path / "r2", log=lambda _: None)
    assert seen == [("strict pilot", True), ("strict pilot variance", True)]
    spec.write_text(yaml % ", first_stage_any_machine: sometimes")
    with pytest.raises(ValueError, match="first_stage_any_machine must be true or false"):
        load_experiment(str(spec))


def test_the_pilot_page_says_where_its_runs_trained_and_which_seeds_span_machines(tmp_path) -> None:
    """Records of one kind of machine get one label even when the early ones do not name the CPU; a seed
    whose runs trained on two kinds is named, arm by arm; with no machine in any record, nothing is said."""
    from studies.pilot import machines_text
    from studies.runs import record_path, write_record

    exp = Experiment(
        name="t",
        recipe="demo",
        arms={"a": {}, "b": {}},
        seeds=[0],
        smooth=1,
        same_machine=True,
        pilot={"seed": 9, "seeds": [9, 10], "learning_rates": [1e-4], "first_stage_any_machine": True},
    )
    xeon = {
        "device": "cpu",
        "cpus": 2,
        "cpu_bf16": ["avx512_bf16"],
        "machine": "x86_64",
        "torch": "2.13.0+cpu",
    }
    amd = {**xeon, "cpu_bf16": [], "cpu_name": "AMD EPYC"}
    records = tmp_path / "records"
    runs = [Run(f"{arm}@0.0001", seed, tmp_path / arm / str(seed), {}) for arm in "ab" for seed in (9, 10)]
    where = {("a", 9): xeon, ("a", 10): {**xeon, "cpu_name": "Xeon"}, ("b", 9): xeon, ("b", 10): amd}
    for r in runs:
        write_record(
            record_path(records, r.arm, r.seed), {"overrides": {}, "environment": where[r.arm[0], r.seed]}
        )
    text = machines_text(exp, runs, records)
    assert "3 runs on cpu (Xeon), 2 CPUs" in text and "1 runs on cpu (AMD EPYC)" in text
    assert "seed 10: a@0.0001 on cpu (Xeon), 2 CPUs, torch 2.13.0+cpu, b@0.0001 on cpu (AMD EPYC)" in text
    assert "seed 9" not in text and "first stage's seeds may span machines" in text
    for r in runs:
        write_record(record_path(records, r.arm, r.seed), {"overrides": {}, "environment": None})
    assert machines_text(exp, runs, records) == ""

"""otbrl compare: the analysis on synthetic runs with known answers, experiment-file errors, and every
packaged experiment's --quick mode end to end (what CI runs to keep the code path alive)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytest.importorskip("otbrl.integrations.trl")

from otbrl.app.studies.compare import compare, events, table  # noqa: E402
from otbrl.app.studies.experiment import Experiment, experiment_names, load_experiment, plan  # noqa: E402
from otbrl.app.studies.outcomes import analyse, collapse_step  # noqa: E402
from otbrl.app.studies.report import markdown_table  # noqa: E402
from otbrl.app.studies.runs import (  # noqa: E402
    Run,
    append_metrics,
    moving_average,
    read_metrics,
    write_metrics,
)


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
        "| a | bb |", "|---|---|", "| 1 | x |", "| long | 2 |",
    ]  # fmt: skip
    assert markdown_table(["a", "bb"], [[1, "x"]]).splitlines() == ["| a | bb |", "|--:|---:|", "| 1 |  x |"]
    with pytest.raises(ValueError, match="rows"):
        markdown_table(["a", "b"], [[1]])


def test_collapse_step() -> None:
    steps = list(range(8))
    assert collapse_step(steps, [0.2, 0.5, 0.6, 0.2, 0.1, 0.1, 0.1, 0.1], 0.5) == 3
    assert collapse_step(steps, [0.2, 0.5, 0.6, 0.2, 0.5, 0.6, 0.6, 0.6], 0.5) is None  # recovered
    assert collapse_step(steps, [0.0] * 8, 0.5) is None  # never had anything to lose
    assert collapse_step(steps, [0.2, 0.3, 0.4, 0.5, 0.6, 0.6, 0.7, 0.7], 0.5) is None


def _fake_run(root: Path, arm: str, seed: int, rewards: list[float], tokens_per_step: float,
              surges: tuple[int, ...] = ()) -> Run:  # fmt: skip
    d = root / arm / f"seed{seed}"
    d.mkdir(parents=True)
    lines = [
        {"step": i + 1, "generated_tokens": tokens_per_step * (i + 1), "reward": r, "grad_norm": 1.0,
         "otb/grad_norm_surge": float(i + 1 in surges)}
        for i, r in enumerate(rewards)
    ]  # fmt: skip
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (d / "summary.json").write_text(json.dumps({"held-out reward after": rewards[-1]}))
    return Run(arm, seed, d, {})


def test_analysis_on_known_runs(tmp_path) -> None:
    exp = Experiment(name="t", recipe="demo", arms={"big": {}, "small": {}, "bad": {}}, seeds=[0, 1],
                     reference="big", smooth=1)  # fmt: skip
    runs = [
        _fake_run(tmp_path, "big", 0, [0.2, 0.6, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], 800),
        _fake_run(tmp_path, "big", 1, [0.2, 0.4, 0.6, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], 800),
        _fake_run(tmp_path, "small", 0, [0.2, 0.4, 0.6, 0.8, 0.9, 1.0, 1.0, 1.0, 1.0, 1.0], 100),
        _fake_run(tmp_path, "small", 1, [0.2, 0.4, 0.6, 0.8, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], 100),
        _fake_run(tmp_path, "bad", 0, [0.2, 0.6, 0.8, 0.3, 0.2, 0.1, 0.1, 0.1, 0.1, 0.1], 100, (3, 4)),
        _fake_run(tmp_path, "bad", 1, [0.2, 0.3, 0.4, 0.5, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6], 100),
    ]
    res = analyse(exp, runs)
    assert res["target"] == pytest.approx(0.9)  # 90% of big's final reward, 1.0
    big, small, bad = (res["arms"][a] for a in ("big", "small", "bad"))
    assert big["tokens_to_target"] == [2400, 3200]  # steps 3 and 4 at 800 tokens each
    assert big["steps_to_target"] == [3, 4] and small["steps_to_target"] == [5, 5]
    assert small["tokens_to_target"] == [500, 500]
    assert small["token_saving"] == pytest.approx(1 - 500 / 2800)
    assert bad["reached"] == 0 and bad["token_saving"] is None
    assert bad["collapses"] == [4, None] and bad["surges"] == 2
    assert bad["first_surge"] == [3, None]
    text = table(exp, res)
    assert "| small | 2 |" in text and "82%" in text and "1/2 (4)" in text

    assert events(res).splitlines()[2:] == ["| bad | 0 | 3 | — | 4 |"]  # only the run with events


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
    assert exp.roles and exp.role("candidate") in exp.arms
    quick = load_experiment(name, quick=True)  # a quick run drops arms; the roles stay as written
    assert quick.roles == exp.roles


def test_plan_keeps_the_prompt_budget(tmp_path) -> None:
    runs = plan(load_experiment("efficiency"), tmp_path)
    assert len(runs) == 6 * 3
    for run in runs:
        n = run.overrides["num_generations"]
        assert run.overrides["per_device_train_batch_size"] == 4 * n
        assert run.overrides["max_steps"] == (60 if n == 32 else 150)
        assert run.overrides["output_dir"] == str(tmp_path / run.arm / f"seed{run.seed}")


@pytest.mark.parametrize("name", experiment_names())
def test_quick_mode_end_to_end(tmp_path, name) -> None:
    lines: list[str] = []
    page, failures = compare(name, quick=True, jobs=2, runs_dir=tmp_path / "runs", results=tmp_path / "out",
                             log=lines.append)  # fmt: skip
    assert failures == []
    exp = load_experiment(name, quick=True)
    text = page.read_text()
    for arm in exp.arms:
        assert f"| {arm} | {len(exp.seeds)} |" in text
    assert (tmp_path / "out" / f"{name}.png").stat().st_size > 10_000
    numbers = json.loads((tmp_path / "out" / f"{name}.json").read_text())
    for stats in numbers["arms"].values():
        assert all(math.isfinite(x) for x in stats["final"] + stats["held_out"])
        assert all(t > 0 for t in stats["total_tokens"])
    if name == experiment_names()[0]:  # resuming: finished runs are kept, not redone
        compare(
            name, quick=True, jobs=2, runs_dir=tmp_path / "runs", results=tmp_path / "out", log=lines.append
        )
        assert any("already done" in line for line in lines)


def test_no_target_when_the_reference_does_not_improve(tmp_path) -> None:
    exp = Experiment(
        name="t", recipe="demo", arms={"big": {}, "small": {}}, seeds=[0], reference="big", smooth=1
    )
    runs = [
        _fake_run(tmp_path, "big", 0, [0.5, 0.4, 0.5, 0.4, 0.5, 0.4, 0.5, 0.4, 0.5, 0.45], 800),
        _fake_run(tmp_path, "small", 0, [0.1] * 10, 100),
    ]
    res = analyse(exp, runs)  # 90% of big's final (0.405) is below where it started (0.5): no target
    assert res["target"] is None and "did not improve" in res["note"]
    assert res["arms"]["small"]["tokens_to_target"] == []


@pytest.mark.parametrize("name", experiment_names())
def test_quick_settings_win_over_each_arms_own(tmp_path, name) -> None:
    """--quick is a smoke run: an arm's own max_steps (150 for efficiency's N=4 arms) must not undo it."""
    quick = load_experiment(name, quick=True)
    forced = quick.forced
    assert forced, f"{name}: its quick section changes nothing"
    for run in plan(quick, tmp_path):
        for key, value in forced.items():
            assert run.overrides[key] == value, (run.arm, key)

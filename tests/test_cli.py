"""The recipe runner and the `otbrl` command: overrides, clear errors before training, a short run with
its outputs, and resume."""

from __future__ import annotations

import json

import pytest

from otbrl.app.cli import main, parse_overrides
from otbrl.app.train import load_recipe, load_rows, recipe_names, run

FAST = {
    "model": "random:tiny",
    "max_steps": 2,
    "per_device_train_batch_size": 8,
    "num_generations": 4,
    "max_completion_length": 6,
    "eval_size": 8,
    "train_size": 64,
    "save_steps": 1,
    "report_to": [],
    "threads": 1,
    "plot": True,
    "disable_tqdm": True,
}


def test_overrides_parse_like_yaml_with_exponent_floats():
    got = parse_overrides(
        ["--learning_rate", "1e-4", "--estimator-options", '{"leave_one_out": true}', "--max_steps=3"]
    )
    assert got == {"learning_rate": 1e-4, "estimator_options": {"leave_one_out": True}, "max_steps": 3}
    with pytest.raises(SystemExit, match="needs a value"):
        parse_overrides(["--max_steps"])


def test_packaged_recipes_load():
    assert {"demo", "running_sum48"} <= set(recipe_names())
    recipe = load_recipe("demo")
    assert recipe["task"] == "running_sum16" and recipe["bf16"] is False


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"learnig_rate": 1e-4}, r"learnig_rate: not a recipe key.*did you mean learning_rate"),
        ({"task": None}, r"task: a recipe needs a built-in task or a dataset"),
        ({"task": "nope"}, r"nope"),
    ],
)
def test_bad_recipes_fail_clearly(overrides, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        recipe = load_recipe("demo", {**overrides, "output_dir": str(tmp_path)})
        load_rows(recipe)


def test_unknown_estimator_fails_before_any_model_is_built(tmp_path):
    # Caught when the recipe is read now (load_recipe), still before any model is built.
    with pytest.raises(ValueError, match=r"advantage_estimator: unknown .*known: .*otb"):
        recipe = load_recipe("demo", {**FAST, "output_dir": str(tmp_path), "advantage_estimator": "nope"})
        run(recipe, log=lambda *_: None)


def test_dataset_without_answer_column_fails_before_training(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{i}+1=", "solution": str(i + 1)}) + "\n" for i in range(20))
    )
    recipe = load_recipe(
        "demo", {"task": None, "dataset": str(data), "reward": "numeric", "output_dir": str(tmp_path)}
    )
    with pytest.raises(ValueError, match=r"dataset: rows lack column 'answer' \(columns: prompt, solution\)"):
        load_rows(recipe)
    recipe["answer_column"] = "solution"
    train, held_out = load_rows(recipe)
    assert len(train) + len(held_out) == 20 and train[0]["answer"].isdigit()


def test_cli_reports_bad_keys_without_traceback(capsys):
    with pytest.raises(SystemExit, match=r"otbrl: learnig_rate: not a recipe key"):
        main(["train", "--config", "demo", "--learnig_rate", "1e-4"])


def test_short_run_writes_its_outputs_and_resumes(tmp_path):
    out = tmp_path / "run"
    summary = run(load_recipe("demo", {**FAST, "output_dir": str(out)}), log=lambda *_: None)
    assert summary["steps"] == 2 and summary["generated tokens"] > 0
    for name in (
        "summary.md",
        "metrics.jsonl",
        "curves.png",
        "recipe.yaml",
        "checkpoint-1",
        "checkpoint-2",
        "final",
    ):
        assert (out / name).exists(), name
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    assert lines[1]["generated_tokens"] > lines[0]["generated_tokens"] > 0
    # Resume: from checkpoint-2 to step 3; the metrics continue where they stopped.
    resumed = run(
        load_recipe("demo", {**FAST, "output_dir": str(out), "max_steps": 3}),
        resume=True,
        log=lambda *_: None,
    )
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3] and resumed["steps"] == 3
    assert lines[2]["generated_tokens"] > lines[1]["generated_tokens"]

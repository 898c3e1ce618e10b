"""Recipes are read as their fields' types and checked before anything heavy: each problem is one line
starting `otbrl:` with exit code 2, and no model is loaded."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("otbrl.integrations.trl")

from otbrl.app import recipe as recipes  # noqa: E402
from otbrl.app import train  # noqa: E402
from otbrl.app.cli import main  # noqa: E402
from otbrl.app.recipe import coerce, load_recipe, parse_value, read_yaml, recipe_names  # noqa: E402


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if anything reaches a model load or a warm start."""

    def refuse(*_, **__):
        raise AssertionError("a model was loaded before the recipe was checked")

    monkeypatch.setattr(train, "load_model", refuse)
    monkeypatch.setattr(train, "load_tokenizer", refuse)


def cli_error(capsys, argv: list[str]) -> str:
    """Run `otbrl ARGV`, expect exit code 2, return its one `otbrl:` line (the last on stderr; a
    datasets progress bar may come before it)."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.strip().splitlines() if line.startswith("otbrl")]
    assert len(lines) == 1 and err.strip().endswith(lines[0]), err
    return lines[0]


def test_yaml_values_follow_yaml_1_2():
    doc = read_yaml("a: no\nb: 1e-4\nc: yes\nd: true\ne: 3\nf: 1.5e3\ng: on\nh: .inf\n")
    want = {"a": "no", "b": 1e-4, "c": "yes", "d": True, "e": 3, "f": 1500.0, "g": "on", "h": float("inf")}
    assert doc == want
    assert parse_value("False") is False and parse_value("-2e-3") == -0.002 and parse_value("x: [") == "x: ["


def test_values_are_read_as_the_field_types():
    assert coerce("save_strategy", "no") == "no"
    assert coerce("learning_rate", "1e-4") == 1e-4 and coerce("learning_rate", 3) == 3.0
    assert coerce("max_steps", "7") == 7 and coerce("bf16", "false") is False
    assert coerce("tools", "[calc]") == ["calc"] and coerce("tools", "calc") == ["calc"]
    assert coerce("estimator_options", "{leave_one_out: true}") == {"leave_one_out": True}
    assert coerce("report_to", ["tensorboard"]) == ["tensorboard"] and coerce("task", "null") is None
    assert coerce("output_dir", 2024) == "2024"  # a string field keeps what YAML wrote, as text
    # fields that default to True also have a --no_<field> flag: the value is still read as a boolean
    assert coerce("plot", "false") is False and coerce("eval_before", "false") is False
    assert coerce("eval_at_tokens", "[1000, 2000]") == [1000, 2000]
    for key, value, match in [
        ("max_steps", "ten", "max_steps: expected an integer, got 'ten'"),
        ("max_steps", 2.5, "max_steps: expected an integer, got 2.5"),
        ("max_steps", True, "max_steps: expected an integer, got True"),
        ("learning_rate", "fast", "learning_rate: expected a number"),
        ("bf16", "maybe", "bf16: expected true or false"),
        ("save_strategy", False, "save_strategy: must be one of no, steps, epoch"),
        ("max_steps", [1, 2], "max_steps: expected a single value"),
        ("learning_rate", {"a": 1}, "learning_rate: expected a single value"),
        ("eval_size", None, "eval_size: needs a value"),
        ("plot", "maybe", "plot: expected true or false"),
    ]:
        with pytest.raises(ValueError, match=match):
            coerce(key, value)


def test_recipe_file_values_arrive_typed(tmp_path, no_model):
    path = tmp_path / "r.yaml"
    path.write_text("task: running_sum16\nmodel: random:tiny\nsave_strategy: no\nlearning_rate: 1e-4\n")
    recipe = load_recipe(str(path))
    assert recipe["save_strategy"] == "no" and recipe["learning_rate"] == 1e-4
    assert recipes.make_config(recipe).learning_rate == 1e-4


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--max_steps", "ten"], "otbrl: max_steps: expected an integer, got 'ten'"),
        (["--num_generations", "0"], "otbrl: num_generations: must be >= 2, got 0"),
        (["--eval_size", "0"], "otbrl: eval_size: must be >= 1, got 0"),
        (["--learning_rate", "-1"], "otbrl: learning_rate: must be >= 0"),
        (["--save_strategy", "sometimes"], "otbrl: save_strategy: must be one of no, steps, epoch"),
        (["--per_device_train_batch_size", "6"], "otbrl: per_device_train_batch_size: per_device_train_b"),
        (
            ["--estimator_options", '{leave_one_out: "false"}'],
            "otbrl: estimator_options: leave_one_out must be true or false (like False), got 'false'",
        ),
        (["--estimator_options", "{eps: yes}"], "otbrl: estimator_options: eps must be a number"),
        (["--estimator_options", "{leave_one_ot: true}"], "otbrl: estimator_options: leave_one_ot: not an"),
        (["--reward", "fuzzy"], "otbrl: reward: unknown reward 'fuzzy'"),
        (["--chat", "true"], "otbrl: chat: warm:/random: models use a character tokenizer"),
    ],
)
def test_bad_values_fail_in_one_line_before_any_model(capsys, no_model, tmp_path, argv, line):
    got = cli_error(capsys, ["train", "--config", "demo", "--output_dir", str(tmp_path / "o"), *argv])
    assert got.startswith(line), got
    assert not (tmp_path / "o").exists()


def test_yaml_syntax_error_is_one_line(capsys, no_model, tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("task: running_sum16\nmax_steps: [3\n")
    got = cli_error(capsys, ["train", "--config", str(path)])
    assert got.startswith(f"otbrl: config {path}: not valid YAML (line 3"), got


def test_two_row_dataset_fails_before_the_model(capsys, no_model, tmp_path):
    data = tmp_path / "two.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(2)))
    got = cli_error(
        capsys,
        [
            "train",
            "--config",
            "demo",
            "--task",
            "null",
            "--dataset",
            str(data),
            "--reward",
            "numeric",
            "--model",
            "random:tiny",
            "--output_dir",
            str(tmp_path / "o"),
            "--per_device_train_batch_size",
            "8",
            "--num_generations",
            "4",
        ],
    )
    assert got.startswith("otbrl: dataset: 1 training prompt(s) after the held-out split, but one step")
    assert "needs 2" in got


def test_every_packaged_recipe_validates_on_this_machine():
    for name in recipe_names():
        load_recipe(name)  # raises on any bad key, type or rule


def test_gsm8k_recipe_is_the_papers_setting():
    recipe = load_recipe("gsm8k-qwen2.5-0.5b")
    assert recipe["model"] == "Qwen/Qwen2.5-0.5B-Instruct" and recipe["dataset"] == "openai/gsm8k"
    assert recipe["chat"] is True and recipe["reward"] == "math" and recipe["bf16"] is True
    assert recipe["use_vllm"] is True and recipe["vllm_mode"] == "colocate"
    assert recipe["advantage_estimator"] == "otb" and recipe["num_generations"] == 4
    # The GRPO N=32 command in the recipe's header: same prompts per optimizer step.
    grpo = load_recipe(
        "gsm8k-qwen2.5-0.5b",
        {"advantage_estimator": "grpo", "num_generations": 32, "gradient_accumulation_steps": 32},
    )
    prompts = [
        r["per_device_train_batch_size"] * r["gradient_accumulation_steps"] // r["num_generations"]
        for r in (recipe, grpo)
    ]
    assert prompts == [16, 16]
    header = (recipes.RECIPES / "gsm8k-qwen2.5-0.5b.yaml").read_text()
    command = "--advantage_estimator grpo --num_generations 32 \\\n#       --gradient_accumulation_steps 32"
    assert command in header

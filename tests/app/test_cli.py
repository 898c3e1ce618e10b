"""The recipe runner and the `otbrl` command: overrides, clear errors before training, a short run with
its outputs, and resume."""

from __future__ import annotations

import json
import warnings

import pytest

from otbrl.app.cli import main, parse_overrides
from otbrl.app.recipe import load_recipe, recipe_names
from otbrl.app.sources import load_rows
from otbrl.app.train import run

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
        "demo",
        {
            "task": None,
            "dataset": str(data),
            "reward": "numeric",
            "model": "random:tiny",
            "output_dir": str(tmp_path),
        },
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
    # The summary of a resumed run counts the whole run's train time, not only the resumed part.
    assert lines[2]["train_seconds"] > lines[1]["train_seconds"] > lines[0]["train_seconds"] > 0
    assert resumed["train seconds"] == round(lines[2]["train_seconds"], 1) >= summary["train seconds"]


def test_the_step_zero_score_is_sampled_where_training_samples(tmp_path, monkeypatch):
    """The held-out score before training is taken once the trainer has placed the model (on a GPU
    machine, the GPU, in training's autocast), not on the CPU it was loaded on."""
    from otbrl.app import train as train_module

    built, seen = [], []

    class Trainer(train_module.OTBGRPOTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self.model.device)

    def evaluate(model, *args, **kwargs):
        seen.append((len(built), model.device))
        return 0.5

    monkeypatch.setattr(train_module, "OTBGRPOTrainer", Trainer)
    monkeypatch.setattr(train_module, "evaluate", evaluate)
    recipe = load_recipe("demo", {**FAST, "output_dir": str(tmp_path), "max_steps": 1, "plot": False})
    assert run({**recipe, "eval_before": True, "eval_at_tokens": []}, log=lambda *_: None)["steps"] == 1
    assert seen and seen[0] == (1, built[0])  # the step-0 evaluation came after the trainer, on its device


def fast_args(out) -> list[str]:
    """FAST as command-line overrides (as `studies compare` passes them: JSON for lists, booleans)."""
    pairs = {**FAST, "output_dir": str(out)}.items()
    return [x for k, v in pairs for x in (f"--{k}", v if isinstance(v, str) else json.dumps(v))]


def test_resume_skips_a_checkpoint_torn_while_saving(tmp_path):
    out = tmp_path / "run"
    first = load_recipe("demo", {**FAST, "output_dir": str(out), "max_steps": 3, "plot": False})
    run(first, log=lambda *_: None)
    # Killed while writing checkpoint-3: its optimizer state is 0 bytes and trainer_state.json is missing.
    (out / "checkpoint-3" / "optimizer.pt").write_bytes(b"")
    (out / "checkpoint-3" / "trainer_state.json").unlink()
    said: list[str] = []
    resumed = run(
        load_recipe("demo", {**FAST, "output_dir": str(out), "max_steps": 4, "plot": False}),
        resume=True,
        log=said.append,
    )
    assert "checkpoint-3 is incomplete (no trainer_state.json, optimizer.pt is empty): skipped" in said
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4] and resumed["steps"] == 4  # each step once
    assert json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())["global_step"] == 4


def test_console_shows_a_compact_line_per_step_and_only_what_was_written(tmp_path, capsys):
    out = tmp_path / "run"
    main(["train", "--config", "demo", *fast_args(out), "--save_strategy", "no"])
    printed = capsys.readouterr().out
    assert "{'loss'" not in printed and "'reward'" not in printed  # no per-step dict of every metric
    steps = [line for line in printed.splitlines() if line.startswith("step ")]
    assert [s.split()[1] for s in steps] == ["1/2", "2/2"]
    assert all("reward " in s and "grad norm " in s and s.endswith("tok/s") for s in steps), steps
    closing = printed.strip().splitlines()[-1]
    assert closing.startswith(f"wrote to {out}: summary.md, summary.json, metrics.jsonl, curves.png")
    assert "final (the trained model)" in closing
    assert "TensorBoard" not in closing and "checkpoint" not in closing  # report_to [] and save_strategy no
    assert not list(out.glob("checkpoint-*")) and not list(out.rglob("events.out.tfevents*"))


def test_a_run_does_not_warn_about_checkpointing_renames_its_user_cannot_change(tmp_path, recwarn):
    """TRL's generation path calls transformers' old gradient-checkpointing names around every step; an
    otbrl command hides those renames, and only those."""
    main(["train", "--config", "demo", *fast_args(tmp_path / "run"), "--save_strategy", "no"])
    renames = [str(w.message) for w in recwarn if "checkpointing" in str(w.message)]
    assert renames == []
    recwarn.clear()
    for name in ("gradient_checkpointing_enable", "is_gradient_checkpointing", "something_else"):
        warnings.warn(f"`{name}` is deprecated and will be removed in v6.", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in recwarn] == ["`something_else` is deprecated and will be removed in v6."]


def test_a_reward_function_that_fails_in_training_stops_the_run_with_its_text(
    tmp_path, capsys, caplog, monkeypatch
):
    from otbrl.app import train

    def flaky(prompts, completions, answer, **kwargs):
        if "trainer_state" in kwargs:  # works for the held-out score, fails inside the trainer
            raise RuntimeError("grader unavailable")
        return [0.0] * len(prompts)

    monkeypatch.setattr(train, "make_reward", lambda recipe: flaky)
    with pytest.raises(SystemExit) as exc:
        main(["train", "--config", "demo", *fast_args(tmp_path / "run")])
    assert exc.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith(
            "otbrl: run stopped: reward function flaky failed on every sample of a batch (8): "
            "RuntimeError: grader unavailable; sample: prompt"
        )
    )
    first = [r.getMessage() for r in caplog.records if r.name == "otbrl.rewards"]
    assert first and first[0].startswith("otbrl: reward function flaky failed: RuntimeError: grader unavail")


@pytest.mark.parametrize("task", [None, "tir_product3"])
def test_compact_decoding_reaches_every_decode_of_a_run(tmp_path, monkeypatch, task):
    """`compact_decoding: true` with `sampler: otbrl` drops ended rows in the training rollouts and in
    every held-out evaluation, single-turn and with tools (paused rows too); left at its default, no
    decode compacts (registered numbers stay put)."""
    import otbrl.integrations.trl.rollout as trl_rollout
    import otbrl.rollout.multiturn as multiturn
    import otbrl.rollout.sampler as sampler

    real, seen = sampler.decode, []

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen.append(kwargs.get("compact", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(sampler, "decode", spy)
    monkeypatch.setattr(trl_rollout, "decode", spy)
    monkeypatch.setattr(multiturn, "decode", spy)
    for compact in (True, False):
        seen.clear()
        keys = {**FAST, "max_steps": 1, "sampler": "otbrl", "compact_decoding": compact}
        keys |= {"task": task} if task else {}
        recipe = load_recipe("demo", {**keys, "output_dir": str(tmp_path / str(compact)), "plot": False})
        run(recipe, log=lambda *_: None)
        assert len(seen) >= 3  # the step-0 evaluation, a training rollout, the final evaluation
        assert seen == [compact] * len(seen)

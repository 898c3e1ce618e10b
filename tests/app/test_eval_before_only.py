"""`eval_before_only`: the step-0 held-out score alone, computed ahead of a seed's runs (studies fill a
session's last hour with them). It must be the number a training run computes at its start, it must land in
the shared cache under the key the runs look up, and a run that reuses it must train exactly as one that
computed it itself."""

from __future__ import annotations

import json

import pytest

from otbrl.app import train as train_module
from otbrl.app.heldout_cache import ENV, EVAL_BEFORE_FILE
from otbrl.app.recipe import load_recipe
from otbrl.app.train import run
from tests.app.test_resume import TINY, _spread_reward


def _run(out, monkeypatch, cache=None, **overrides) -> dict:
    if cache is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, str(cache))
    keys = {**TINY, "eval_before": True, "max_steps": 1, "output_dir": str(out), **overrides}
    return run(load_recipe("smollm2-draws", keys), log=lambda *_: None)


def _rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_the_step0_score_alone_is_the_one_a_run_computes_and_a_run_reusing_it_trains_the_same(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr(train_module, "make_reward", _spread_reward)  # scores that differ between samples
    ran, ahead = tmp_path / "cache-run", tmp_path / "cache-ahead"
    full = _run(tmp_path / "full", monkeypatch, ran)  # a training run, computing its own step-0 score
    other_arm = {"advantage_estimator": "grpo", "num_generations": 4, "learning_rate": 3e-4}
    only = _run(tmp_path / "only", monkeypatch, ahead, eval_before_only=True, **other_arm)
    (computed,) = ran.glob("*.json")
    (alone,) = ahead.glob("*.json")
    assert alone.name == computed.name  # the key a run looks up
    assert json.loads(alone.read_text()) == json.loads(computed.read_text())  # the number, every bit
    score = json.loads(alone.read_text())["score"]
    assert 0 < score < 1 and only["held-out reward before"] == score and not only["reused"]
    assert full["held-out reward before"] == round(score, 3)
    assert not (tmp_path / "only" / "metrics.jsonl").exists()  # no training step
    assert not (tmp_path / "only" / "summary.json").exists()  # which would say a run finished
    assert train_module.written(tmp_path / "only") == [
        EVAL_BEFORE_FILE,
        "recipe.yaml",
    ]  # what the run says it left
    assert json.loads((tmp_path / "only" / EVAL_BEFORE_FILE).read_text())["held-out reward before"] == score

    evaluations: list[int] = []
    real = train_module.evaluate

    def counted(*args, **kwargs):
        evaluations.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(train_module, "evaluate", counted)
    again = _run(tmp_path / "again", monkeypatch, ahead)  # reuses the score computed ahead
    assert again["held-out reward before"] == full["held-out reward before"]
    assert evaluations == [1]  # the final one only: the step-0 score was found, not sampled again

    def steps(out) -> list[dict]:
        return [{k: v for k, v in r.items() if "second" not in k and "time" not in k} for r in _rows(out)]

    assert steps(tmp_path / "again") == steps(tmp_path / "full")  # skipping the evaluation changes no step


def test_eval_before_only_needs_eval_before() -> None:
    with pytest.raises(ValueError, match="eval_before_only"):
        load_recipe("smollm2-draws", {**TINY, "eval_before": False, "eval_before_only": True})

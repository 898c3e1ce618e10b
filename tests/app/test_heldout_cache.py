"""The step-0 held-out score shared by runs that would compute the same one: the key changes with every
input the score depends on, a reused score equals a fresh evaluation, and a torn file is recomputed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from otbrl.app.heldout_cache import before_key, cached_score, weights_digest
from otbrl.rollout import evaluate
from otbrl.tasks import char_tokenizer, dataset, get_task
from otbrl.tasks.models import tiny_model

SETTINGS = {"max_new_tokens": 8, "temperature": 1.0, "seed": 0, "tools": [], "max_turns": 0, "bf16": False}


def _model(seed: int = 0) -> torch.nn.Module:
    return tiny_model(seed=seed)


def _rows(n: int = 6) -> list[dict[str, str]]:
    return dataset("reverse", n, 1, split="heldout")


def test_the_key_changes_with_every_input_and_only_then(monkeypatch) -> None:
    model, rows = _model(), _rows()
    key = before_key(model, None, rows, SETTINGS)
    assert key == before_key(_model(), None, _rows(), dict(SETTINGS))  # a fresh load of the same
    assert key != before_key(_model(seed=1), None, rows, SETTINGS)  # other weights
    assert key != before_key(model, None, rows[:-1], SETTINGS)  # other prompts
    assert key != before_key(model, None, rows, {**SETTINGS, "seed": 1})  # other sampling seed
    assert key != before_key(model, None, rows, {**SETTINGS, "temperature": 0.7})
    assert key != before_key(model, char_tokenizer(), rows, SETTINGS)  # a tokenizer
    with monkeypatch.context() as m:  # where it samples (a GPU, say) decides its draws too
        m.setattr(type(model), "device", property(lambda self: torch.device("meta")))
        assert key != before_key(model, None, rows, SETTINGS)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)  # other float reductions, possibly other samples
        assert key != before_key(model, None, rows, SETTINGS)
    finally:
        torch.set_num_threads(threads)


def test_one_changed_weight_changes_the_digest() -> None:
    model = _model()
    digest = weights_digest(model)
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] += 1e-6
    assert weights_digest(model) != digest


def test_a_reused_score_equals_a_fresh_evaluation(tmp_path: Path) -> None:
    task, rows, tok = get_task("reverse"), _rows(), char_tokenizer()

    def score(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
        return [task.reward(c, a) for c, a in zip(completions, answers, strict=True)]

    def fresh() -> float:
        return evaluate(_model(), tok, rows, score, 8, 1.0, seed=3)

    calls = []

    def counted() -> float:
        calls.append(1)
        return fresh()

    key = before_key(_model(), tok, rows, SETTINGS)
    first, reused_first = cached_score(tmp_path, key, counted)
    second, reused_second = cached_score(tmp_path, key, counted)
    assert (reused_first, reused_second, len(calls)) == (False, True, 1)
    assert first == second == fresh()  # the arm that reuses gets what it would have computed


@pytest.mark.parametrize("content", ["", "{", '{"other": 1}', '{"score": "x"}'])
def test_a_torn_or_foreign_file_is_computed_again(tmp_path: Path, content: str) -> None:
    (tmp_path / "k.json").write_text(content)
    assert cached_score(tmp_path, "k", lambda: 0.25) == (0.25, False)
    assert json.loads((tmp_path / "k.json").read_text()) == {"score": 0.25}


def test_a_computed_score_is_labelled_with_its_seed_and_a_labelled_entry_is_reused(tmp_path: Path) -> None:
    assert cached_score(tmp_path, "k", lambda: 0.25, seed=7) == (0.25, False)
    assert json.loads((tmp_path / "k.json").read_text()) == {"score": 0.25, "seed": 7}
    assert cached_score(tmp_path, "k", lambda: 0.5, seed=7) == (0.25, True)


def test_no_folder_means_no_cache(tmp_path: Path) -> None:
    calls = []
    for _ in range(2):
        assert cached_score(None, "k", lambda: calls.append(1) or 0.5) == (0.5, False)
    assert len(calls) == 2 and not list(tmp_path.iterdir())

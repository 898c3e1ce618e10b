"""A multi-turn run (otbrl's sampler, an episode per completion, the turn cache) stopped after a checkpoint
and continued with `resume` ends where the uninterrupted run ends, and saving checkpoints changes no
number: what `studies` relies on to continue a stopped run instead of training it again."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from otbrl.app import train as train_module
from otbrl.app.answers import completion_text
from otbrl.app.recipe import load_recipe
from otbrl.app.train import run

TINY = {
    "model": "random:tiny",
    "model_fallback": None,
    "sft_steps": 0,
    "max_steps": 4,
    "max_completion_length": 24,
    "eval_size": 4,
    "eval_samples": 2,
    "eval_before": False,
    "eval_at_tokens": [],
    "train_size": 64,
    "learning_rate": 1e-2,  # large, so that the 4 steps move the weights visibly
    "report_to": [],
    "threads": 1,
    "plot": False,
    "disable_tqdm": True,
    "compact_decoding": True,
    "turn_cache": True,
}


def _spread_reward(recipe: dict) -> object:
    """A reward that differs between a random model's completions (the task's is 0 for all of them, so
    no update would move the weights): the share of the completion's characters that are vowels."""

    def reward(prompts: list, completions: list, answer: list[str], **_: object) -> list[float]:
        texts = [completion_text(c) for c in completions]
        return [sum(ch in "aeiou" for ch in t) / max(1, len(t)) for t in texts]

    return reward


def _train(out, **overrides) -> dict:
    recipe = load_recipe("smollm2-draws", {**TINY, "output_dir": str(out), **overrides})
    return run(recipe, log=lambda *_: None)


def _rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Four steps without a checkpoint; saving every second step; saving every step, keeping the newest
    checkpoint only; with gradient checkpointing (activations recomputed in the backward); and the second
    run's
    checkpoint-2 continued to step 4 in a copy of its directory, as if the process had been killed there."""
    tmp = tmp_path_factory.mktemp("resume")
    threads = torch.get_num_threads()
    patch = pytest.MonkeyPatch()
    patch.setattr(train_module, "make_reward", _spread_reward)
    try:
        _train(tmp / "plain", save_steps=1000)
        _train(tmp / "saving", save_steps=2)
        _train(tmp / "limited", save_steps=1, save_total_limit=1)
        _train(tmp / "recomputed", save_steps=1000, gradient_checkpointing=True)
        cut = tmp / "cut"
        shutil.copytree(tmp / "saving" / "checkpoint-2", cut / "checkpoint-2")
        (cut / "metrics.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in _rows(tmp / "saving") if r["step"] <= 2)
        )
        recipe = load_recipe("smollm2-draws", {**TINY, "output_dir": str(cut), "save_steps": 2})
        run(recipe, resume=True, log=lambda *_: None)
    finally:
        patch.undo()
        torch.set_num_threads(threads)
    return tmp


def _weights(folder) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "final" / "model.safetensors"))


def test_saving_checkpoints_and_checkpointing_activations_change_no_number(runs) -> None:
    plain = runs / "plain"
    assert [p.name for p in plain.glob("checkpoint-*")] == ["checkpoint-4"]  # the Trainer saves at its end
    assert sorted(p.name for p in (runs / "saving").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert [p.name for p in (runs / "limited").glob("checkpoint-*")] == ["checkpoint-4"]  # save_total_limit
    a = _weights(plain)
    for other in ("saving", "limited", "recomputed"):  # recomputed: activations checkpointed, not kept
        b = _weights(runs / other)
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), (other, name)
        for x, y in zip(_rows(plain), _rows(runs / other), strict=True):
            for key in ("reward", "loss", "grad_norm", "generated_tokens", "otb/energy/mean"):
                assert x[key] == y[key], (other, x["step"], key)


def test_a_run_continued_from_its_checkpoint_ends_where_the_uninterrupted_run_ends(runs) -> None:
    whole, cut = runs / "saving", runs / "cut"
    rows, resumed = _rows(whole), _rows(cut)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    # steps 3-4 sampled the same completions (lengths, tool calls, rewards) and took the same updates
    for x, y in zip(rows[2:], resumed[2:], strict=True):
        for key in ("reward", "loss", "grad_norm", "generated_tokens", "otb/energy/mean"):
            assert y[key] == pytest.approx(x[key], rel=1e-6, abs=1e-9), (x["step"], key)
    a, b, moved = _weights(whole), _weights(cut), 0.0
    at_cut = load_file(str(cut / "checkpoint-2" / "model.safetensors"))
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-6, msg=name)
        moved = max(moved, (a[name] - at_cut[name]).abs().max().item())
    assert moved > 1e-4  # steps 3-4 trained
    assert rows[-1]["generated_tokens"] > rows[1]["generated_tokens"] > 0

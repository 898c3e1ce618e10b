"""Held-out means unseen by every training stage (issue 33): with `warm_start_split: train`, neither the
supervised warm start (its training draws and the prompts it picks its stopping point on) nor the RL
training rows ever hold a held-out prompt; `walk_pairs` keeps a walk and its reversal on one side."""

from __future__ import annotations

import random

import pytest

from otbrl.tasks import warmstart
from otbrl.tasks.builtin import TASKS, dataset, get_task, walk_pair
from otbrl.tasks.split import held_out


def _held(task, prompt: str) -> bool:  # noqa: ANN001
    return held_out(task.split_key(prompt) if task.split_key else prompt, task.heldout_fraction, task.name)


@pytest.mark.parametrize("name", sorted(TASKS))
def test_no_training_draw_of_any_stage_is_held_out(name):
    task = get_task(name)
    rng = random.Random(0)
    supervised = [p for p, _ in warmstart.draws(task, rng, 400, "train")]
    rl = [r["prompt"] for r in dataset(task, 400, seed=3, split="train")]
    assert not any(_held(task, p) for p in supervised + rl)
    whole = [p for p, _ in warmstart.draws(task, random.Random(0), 400, None)]
    assert any(_held(task, p) for p in whole)  # the check can fail: the whole space holds some


def test_walk_pairs_keeps_every_reversal_on_its_walks_side():
    task = get_task("walk_pairs")
    rng = random.Random(1)
    for _ in range(2000):
        prompt, _ = task.make(rng)
        a, _, b = prompt.rstrip(":").partition(" to ")
        assert walk_pair(prompt) == walk_pair(f"{b} to {a}:")
        assert _held(task, prompt) == _held(task, f"{b} to {a}:")
    heldout = dataset(task, 1024, seed=0, split="heldout")
    assert len({r["prompt"] for r in heldout}) == 1024  # enough distinct held-out prompts to score 1,024
    trained = {walk_pair(r["prompt"]) for r in dataset(task, 4000, seed=0, split="train")}
    assert not trained & {walk_pair(r["prompt"]) for r in heldout}


def test_plain_walk_shares_reversals_across_its_split():
    """Why walk_pairs exists: walk's split is keyed on the directed prompt, so reversals straddle it."""
    task = get_task("walk")
    rng = random.Random(2)
    straddle = 0
    for _ in range(500):
        prompt, _ = task.make(rng)
        a, _, b = prompt.rstrip(":").partition(" to ")
        straddle += _held(task, prompt) != _held(task, f"{b} to {a}:")
    assert straddle > 100


def test_a_training_side_warm_start_sees_no_held_out_prompt(monkeypatch, tmp_path):
    """The whole warm start with split="train": every prompt it trains on and every prompt it evaluates
    to pick its stopping point lies on the training side; its cache key differs from the whole-space
    checkpoint's, which keeps its key (the registered experiments' starts)."""
    task = get_task("walk_pairs")
    trained, scored = [], []

    def fake_step(model, opt, tokenizer, rows):  # noqa: ANN001, ANN202
        trained.extend(r["prompt"] for r in rows)
        return 1.0

    def fake_eval(model, tokenizer, rows, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        scored.extend(r["prompt"] for r in rows)
        return 0.0

    monkeypatch.setattr(warmstart, "_train_step", fake_step)
    monkeypatch.setattr(warmstart, "evaluate", fake_eval)
    _, _, info = warmstart.warm_start(
        "walk_pairs", max_seconds=0.5, eval_every=2, eval_size=64, split="train", cache_dir=tmp_path, log=None
    )
    assert trained and scored and info["split"] == "train" and "--split train" in info["command"]
    assert not any(_held(task, p) for p in trained + scored)
    names = ("task", "preset", "seed", "target_reward", "batch_size", "lr", "weight_decay", "eval_every")
    spec = {k: info[k] for k in (*names, "eval_size", "version")}
    saved = [p.name for p in tmp_path.iterdir()]
    assert saved == [warmstart._cache_key({**spec, "split": "train"})]
    assert saved[0] != warmstart._cache_key(spec)  # never mistaken for the whole-space checkpoint
    with pytest.raises(ValueError, match="split"):
        warmstart.warm_start("walk", split="heldout", cache_dir=False, log=None)


def test_the_whole_space_key_is_unchanged():
    """The shipped walk checkpoint that walk3 starts from is still found under its old key."""
    spec = {
        "task": "walk",
        "preset": "small",
        "seed": 0,
        "target_reward": 0.3,
        "batch_size": 64,
        "lr": 1e-3,
        "weight_decay": 0.1,
        "eval_every": 25,
        "eval_size": 256,
        "version": warmstart.WARM_START_VERSION,
    }
    assert (warmstart.SHIPPED / warmstart._cache_key(spec)).is_dir()


def test_the_shipped_walk_pairs_start_was_trained_on_the_training_side():
    """The checkpoint that `walk-pairs` starts from is found under its training-side key and says so."""
    import json

    info = json.loads((warmstart.SHIPPED / "walk_pairs-small-54405bae9589" / "info.json").read_text())
    assert info["split"] == "train" and info["reached"] and "--split train" in info["command"]
    model, _, loaded = warmstart.warm_start("walk_pairs", split="train", max_seconds=3000, log=None)
    assert loaded["cached"] and loaded["split"] == "train"

"""The hash split of a task's prompt space: held-out prompts can never be drawn for training."""

import random

import pytest

from otbrl.tasks import TASKS, dataset
from otbrl.tasks.split import draw, held_out


@pytest.mark.parametrize("name", sorted(TASKS))
def test_train_and_heldout_never_share_a_prompt(name):
    task = TASKS[name]
    key = task.split_key or (lambda prompt: prompt)
    train = {key(r["prompt"]) for r in dataset(name, 400, seed=0, split="train")}
    heldout = {key(r["prompt"]) for r in dataset(name, 100, seed=1, split="heldout")}
    assert train and heldout and not train & heldout  # no shared prompt, nor problem where keyed
    assert all(held_out(k, task.heldout_fraction, name) for k in heldout)
    assert not any(held_out(k, task.heldout_fraction, name) for k in train)


def test_split_rows_are_reproducible_and_whole_space_unchanged():
    assert dataset("reverse", 30, seed=4, split="train") == dataset("reverse", 30, seed=4, split="train")
    # split=None keeps the old draw (the shipped warm starts and studies were made with it)
    rng = random.Random("reverse:4")
    old = [dict(zip(("prompt", "answer"), TASKS["reverse"].make(rng), strict=True)) for _ in range(30)]
    assert dataset("reverse", 30, seed=4) == old


def test_held_out_share_matches_the_fraction():
    keys = [f"prompt {i}" for i in range(20_000)]
    share = sum(held_out(k, 0.3) for k in keys) / len(keys)
    assert abs(share - 0.3) < 0.015  # binomial SD 0.0032
    # another salt gives another split of the same prompts
    assert [held_out(k, 0.3, "a") for k in keys[:200]] != [held_out(k, 0.3, "b") for k in keys[:200]]


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 2.0])
def test_bad_fraction_is_refused(fraction):
    with pytest.raises(ValueError, match="fraction"):
        held_out("x", fraction)


def test_bad_split_and_empty_side_are_clear_errors():
    with pytest.raises(ValueError, match="split"):
        draw(lambda: ("x", "y"), "test", 0.5)  # type: ignore[arg-type]
    side = "heldout" if held_out("only", 0.5) else "train"
    other = "train" if side == "heldout" else "heldout"
    assert draw(lambda: ("only", "1"), side, 0.5) == ("only", "1")
    with pytest.raises(RuntimeError, match="no .* prompt"):
        draw(lambda: ("only", "1"), other, 0.5, tries=50)


def test_heldout_rows_are_distinct_and_a_too_small_side_is_refused():
    rows = dataset("walk", 1024, seed=1, split="heldout")  # walk: 3,444 prompts, 1,142 held out
    assert len({r["prompt"] for r in rows}) == 1024
    train = {r["prompt"] for r in dataset("walk", 4096, seed=0, split="train")}
    assert not train & {r["prompt"] for r in rows}
    with pytest.raises(ValueError, match="distinct held-out prompts"):
        dataset("walk", 1200, seed=1, split="heldout")


def test_chat_problems_fall_on_one_side_in_every_wording():
    from otbrl.tasks.chat import problem_key

    assert problem_key("What is 7 + 12? Reply with the number only.") == problem_key("What is 12 + 7?")
    rows = dataset("chat_rows", 300, seed=0, split="train")
    assert len({r["prompt"] for r in rows}) > len({problem_key(r["prompt"]) for r in rows})  # wordings vary

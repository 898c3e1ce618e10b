"""Worked solutions of the chat sum tasks: every step's arithmetic is right, the task's own reward scores
each style correct, the styles come in their weights, and a prompt that is not a plain sum is refused."""

from __future__ import annotations

import random
import re
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from otbrl.tasks import dataset, get_task
from otbrl.tasks.chat_problems import PROBLEM_TASKS
from otbrl.tasks.worked import STYLES, WEIGHTS, sum_terms, worked, worked_solution

SUM_TASKS = ["chat_addlist", "chat_addlist_work", "chat_basket", "chat_pair"]


@given(st.lists(st.integers(0, 999), min_size=2, max_size=8), st.sampled_from(STYLES))
def test_every_step_adds_up_and_ends_on_the_total(terms, style) -> None:
    text = worked(terms, style)
    assert text.endswith(f"The total is {sum(terms)}.")
    steps = re.findall(r"(\d+(?: \+ \d+)+) = (\d+)\.", text)
    for left, right in steps:
        assert sum(int(t) for t in left.split(" + ")) == int(right)
    want = {"brief": 0, "whole": 1, "steps": len(terms) - 1}[style]
    assert len(steps) == want
    if style == "steps":  # the running total, one term at a time, in the prompt's order
        assert [int(r) for _, r in steps] == [sum(terms[: i + 2]) for i in range(len(terms) - 1)]


@pytest.mark.parametrize("name", SUM_TASKS)
def test_each_sum_task_demonstrates_answers_its_reward_scores_correct(name) -> None:
    task = get_task(name)
    assert task.demonstrate is not None
    rng = random.Random(0)
    for row in dataset(task, 300, seed=1, split="train"):
        (text, trained), *rest = task.demonstrate(row["prompt"], row["answer"], rng)
        assert not rest and trained and task.reward(text, row["answer"]) == 1.0


def test_styles_come_in_their_weights() -> None:
    rng = random.Random(3)
    counts = Counter(
        "brief" if "=" not in s else "steps" if s.count("=") > 1 else "whole"
        for s in (worked_solution("What is 3 + 8 + 5?", "16", rng) for _ in range(4000))
    )
    for style, weight in zip(STYLES, WEIGHTS, strict=True):
        assert abs(counts[style] / 4000 - weight) < 0.03


def test_a_prompt_that_is_not_a_plain_sum_is_refused() -> None:
    with pytest.raises(ValueError, match="not a sum problem"):
        sum_terms("What is 38 - 23?", "15")
    with pytest.raises(ValueError, match="not a sum problem"):
        sum_terms("What is seven?", "7")
    with pytest.raises(ValueError, match="style"):
        worked([1, 2], "poem")
    # tasks whose prompts are not plain sums (differences, examples, stories of losses) have no demonstration
    for name in ("chat_pair_mixed", "chat_addlist_shown", "chat_story", "chat_units"):
        assert PROBLEM_TASKS[name].demonstrate is None

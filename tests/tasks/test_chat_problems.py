"""The problem-keyed chat tasks of issue 34 (otbrl.tasks.chat_problems): each poses the problem it states,
its enumeration is its problem space (>= 1,000 problems, >= 250 held out), every wording of a problem gets
the problem's key, training draws never reach a held-out problem in any wording, and draws are
reproducible."""

from __future__ import annotations

import hashlib
import json
import random
import re

import pytest

from otbrl.tasks import dataset, get_task
from otbrl.tasks.chat_problems import (
    CONVERSIONS,
    PROBLEM_TASKS,
    draw_story,
    draw_terms,
    draw_units,
    make_addlist,
    make_addlist_work,
    make_basket,
    make_story,
    make_units,
    pose_basket,
    pose_story,
    pose_sum,
    pose_units,
    solve_units,
    units_key,
)
from otbrl.tasks.split import held_out

NAMES = sorted(PROBLEM_TASKS)


def _numbers(prompt: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", prompt)]


@pytest.mark.parametrize("name", NAMES)
def test_space_is_large_and_holds_out_at_least_250_problems(name):
    task = get_task(name)
    keys = task.problems()
    heldout = [k for k in keys if held_out(k, task.heldout_fraction, name)]
    assert len(keys) >= 1000
    assert len(heldout) >= 250
    assert 0.25 < len(heldout) / len(keys) < 0.35  # the hash split keeps about heldout_fraction


@pytest.mark.parametrize("name", NAMES)
def test_drawn_prompts_have_keys_of_the_enumerated_space(name):
    task = get_task(name)
    keys = task.problems()
    rows = dataset(name, 500, seed=3)
    assert {task.split_key(r["prompt"]) for r in rows} <= keys


@pytest.mark.parametrize("name", NAMES)
def test_no_heldout_problem_is_drawn_for_training_in_any_wording(name):
    task = get_task(name)
    train = dataset(name, 3000, seed=0, split="train")
    # every wording of the problem keeps its key, so a train row whose key is held out would be a leak
    assert not any(held_out(task.split_key(r["prompt"]), task.heldout_fraction, name) for r in train)
    heldout = dataset(name, 300, seed=1, split="heldout")
    train_keys = {task.split_key(r["prompt"]) for r in train}
    held_keys = {task.split_key(r["prompt"]) for r in heldout}
    assert not train_keys & held_keys
    assert len(held_keys) >= 150  # held-out rows pose many distinct problems, not one in many wordings
    # the held-out answers are those of the held-out problems: no training row poses one of them
    train_prompts = {r["prompt"] for r in train}
    assert not train_prompts & {r["prompt"] for r in heldout}


@pytest.mark.parametrize("name", NAMES)
def test_draws_are_reproducible(name):
    assert dataset(name, 50, seed=7, split="train") == dataset(name, 50, seed=7, split="train")
    assert dataset(name, 50, seed=7, split="heldout") == dataset(name, 50, seed=7, split="heldout")
    assert dataset(name, 50, seed=7, split="train") != dataset(name, 50, seed=8, split="train")


def test_sums_key_every_wording_and_order_alike():
    rng = random.Random(0)
    for _ in range(200):
        terms = draw_terms(rng)
        shuffled = rng.sample(terms, len(terms))
        keys = {
            get_task("chat_addlist").split_key(pose_sum(t, w)) for w in range(4) for t in (terms, shuffled)
        }
        keys |= {get_task("chat_basket").split_key(pose_basket(terms, w, rng)) for w in range(2)}
        assert keys == {",".join(map(str, sorted(terms)))}


def test_sum_prompts_pose_their_answers():
    rng = random.Random(1)
    for make in (make_addlist, make_addlist_work, make_basket):
        for _ in range(200):
            prompt, answer = make(rng)
            terms = _numbers(prompt)
            assert 2 <= len(terms) <= 5 and all(1 <= t <= 9 for t in terms)
            assert int(answer) == sum(terms)
    assert make_addlist_work(random.Random(2))[0].endswith("one at a time, then give the total.")


def test_units_key_every_wording_alike_and_order_matters():
    rng = random.Random(0)
    for _ in range(300):
        conversion, numbers = draw_units(rng)
        keys = {units_key(pose_units(conversion, numbers, w)) for w in range(3)}
        big, _, small, _, _ = CONVERSIONS[conversion]
        assert keys == {f"{big}>{small}:" + ",".join(map(str, numbers))}
    assert units_key("How many minutes are in 3 hours and 15 minutes?") == "hours>minutes:3,15"
    assert units_key("How many seconds are in 3 minutes?") == "minutes>seconds:3"
    assert units_key("Convert 1 foot and 2 inches to inches.") == "feet>inches:1,2"
    with pytest.raises(ValueError, match="conversion"):
        units_key("How many apples are in 3 boxes?")


def test_units_answers():
    assert solve_units(0, (3, 15)) == 195 and solve_units(7, (2,)) == 2000
    rng = random.Random(3)
    for _ in range(300):
        prompt, answer = make_units(rng)
        numbers = _numbers(prompt)
        pair = units_key(prompt).partition(":")[0]
        factor = next(c[4] for c in CONVERSIONS if f"{c[0]}>{c[2]}" == pair)
        assert int(answer) == numbers[0] * factor + sum(numbers[1:])


def test_stories_pose_their_answers_and_never_go_below_zero():
    rng = random.Random(0)
    for _ in range(500):
        start, changes = draw_story(rng)
        assert 1 <= len(changes) <= 3
        totals = [start + sum(changes[: i + 1]) for i in range(len(changes))]
        assert min(totals) >= 0
        prompt = pose_story(start, changes, rng)
        assert get_task("chat_story").split_key(prompt) == ",".join(
            map(str, sorted([start, *map(abs, changes)]))
        )
    for _ in range(300):
        prompt, answer = make_story(rng)
        start, *steps = _numbers(prompt)
        signs = [
            -1 if re.search(rf"(gives {n} away|loses {n}|sells {n})", s) else 1
            for n, s in zip(steps, prompt.split(". ")[1:], strict=False)
        ]
        assert int(answer) == start + sum(s * n for s, n in zip(signs, steps, strict=True))


def test_worked_example_prompts_key_and_answer_the_question_after_the_example():
    from otbrl.tasks.chat_problems import EXAMPLE_BREAK, after_example, make_addlist_shown, make_story_shown

    rng = random.Random(5)
    for make in (make_addlist_shown, make_story_shown):
        for _ in range(100):
            prompt, answer = make(rng)
            example, _, question = prompt.partition(EXAMPLE_BREAK)
            assert example.startswith("Example: ") and after_example(prompt) == question
            name = "chat_addlist_shown" if make is make_addlist_shown else "chat_story_shown"
            key = get_task(name).split_key(prompt)
            assert key == ",".join(
                map(str, sorted(_numbers(question)))
            )  # the example's numbers are not in it
    prompt, answer = make_addlist_shown(random.Random(0))
    assert int(answer) == sum(_numbers(after_example(prompt)))


def test_chat_rows_and_chat_sums_draw_what_they_drew_before_issue_34():
    """The smollm2 experiment's prompts: the same rows, byte for byte, as before these tasks were added
    (the digest was taken at the commit before them)."""
    blob = json.dumps(
        [
            dataset("chat_rows", 400, seed=0, split="train"),
            dataset("chat_rows", 256, seed=1, split="heldout"),
            dataset("chat_sums", 100, seed=0, split="train"),
        ]
    )
    assert hashlib.sha256(blob.encode()).hexdigest() == (
        "a87c7b9d9fdf01065ae0958ba7601eaaf948037fc753fe3070fce0fe3ff19f96"
    )
    assert get_task("chat_rows").problems is None


def test_two_number_spaces_are_counted_exactly():
    from otbrl.tasks.chat_problems import pair_problems, signed_pair_problems

    assert len(pair_problems()) == 50 * 51 // 2 == 1275
    assert len(signed_pair_problems()) == 2 * 1275
    for name, expected in (("chat_pair", 1275), ("chat_pair_mixed", 2550), ("chat_pair_story", 2550)):
        task = get_task(name)
        keys = task.problems()
        heldout = sum(held_out(k, task.heldout_fraction, name) for k in keys)
        assert len(keys) == expected and heldout >= 250


def test_two_number_prompts_pose_their_answers_with_one_step():
    from otbrl.tasks.chat_problems import make_pair, make_pair_mixed, make_pair_story

    rng = random.Random(4)
    ops = {"+": 0, "-": 0}
    for make, name in (
        (make_pair, "chat_pair"),
        (make_pair_mixed, "chat_pair_mixed"),
        (make_pair_story, "chat_pair_story"),
    ):
        for _ in range(400):
            prompt, answer = make(rng)
            a, b = _numbers(prompt)  # exactly two numbers: one step
            assert 1 <= a <= 50 and 1 <= b <= 50
            key = get_task(name).split_key(prompt)
            op = key[0] if key[1] == ":" else "+"
            # "Subtract 8 from 23" names the smaller first: a difference is the larger less the smaller
            assert int(answer) == (a + b if op == "+" else max(a, b) - min(a, b))
            assert key.rpartition(":")[2] == ",".join(map(str, sorted((a, b))))
            if name != "chat_pair":
                ops[op] += 1
    assert min(ops.values()) > 300  # sums and differences both drawn, about half each


def test_two_number_keys_read_the_operation_from_every_wording():
    from otbrl.tasks.chat_problems import pose_pair_story, pose_sub, signed_key

    rng = random.Random(6)
    for _ in range(100):
        a, b = sorted((rng.randint(1, 50), rng.randint(1, 50)), reverse=True)
        plus = {signed_key(pose_sum([a, b], w)) for w in range(4)} | {signed_key(pose_sum([b, a], 0))}
        plus |= {signed_key(pose_pair_story(a, b, False, w, rng)) for w in range(4)}
        plus |= {signed_key(pose_pair_story(b, a, False, w, rng)) for w in range(4)}
        minus = {signed_key(pose_sub(a, b, w)) for w in range(4)}
        minus |= {signed_key(pose_pair_story(a, b, True, w, rng)) for w in range(4)}
        assert plus == {f"+:{b},{a}"} and minus == {f"-:{b},{a}"}
    assert signed_key("Take 8 away from 23. What is left?") == "-:8,23"
    assert (
        signed_key("Mia has 23 cards and Tom has 8 cards. How many cards do they have together?") == "+:8,23"
    )


def test_two_number_rewards_read_the_final_number():
    task = get_task("chat_pair_mixed")
    assert task.reward("38 - 23 = 15. The answer is 15.", "15") == 1.0
    assert task.reward("The answer is 15, or maybe 16.", "15") == 0.0
    assert task.reward("I do not know.", "15") == 0.0
    for row in dataset("chat_pair_story", 20, seed=0):
        assert get_task("chat_pair_story").reward(f"So that makes {row['answer']}.", row["answer"]) == 1.0


@pytest.mark.parametrize("name", [*NAMES[:2], "chat_draws_told"])
def test_an_evaluation_of_distinct_problems_poses_each_held_out_problem_once(name):
    """`distinct_problems`: n held-out rows are n problems (the units a score averages over), not fewer
    problems in several wordings, still never one a training row poses."""
    task = get_task(name)
    rows = dataset(name, 256, seed=1, split="heldout", distinct_problems=True)
    keys = [task.split_key(r["prompt"]) for r in rows]
    assert len(rows) == len(set(keys)) == 256
    assert all(held_out(k, task.heldout_fraction, name) for k in keys)
    by_prompt = {task.split_key(r["prompt"]) for r in dataset(name, 256, seed=1, split="heldout")}
    assert len(by_prompt) < 256 or name != "chat_draws_told"  # the default counts wordings, not problems
    side = sum(held_out(k, task.heldout_fraction, name) for k in task.problems())
    with pytest.raises(ValueError, match="distinct held-out problems"):
        dataset(name, side + 1, seed=1, split="heldout", distinct_problems=True)

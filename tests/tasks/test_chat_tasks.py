"""The real-model tasks: prompts a chat model reads, rewards by the final number, problems keyed by their
numbers (tests/tasks/test_split.py checks the held-out side)."""

import random

import pytest

from otbrl.tasks import dataset, get_task
from otbrl.tasks.chat import final_number_reward, make_rows, make_sum


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("19", 1.0),
        ("The answer is 19.", 1.0),
        ("7 + 12 = 19", 1.0),
        ("19 apples, or 20 if you count the gift", 0.0),  # the final number decides
        ("1,9", 0.0),
        ("It is 190.", 0.0),
        ("nineteen", 0.0),
        ("", 0.0),
        ("19.0", 1.0),
    ],
)
def test_final_number_reward(completion, expected):
    assert final_number_reward(completion, "19") == expected


def test_thousands_separators_and_negatives():
    assert final_number_reward("There are 1,024 cups.", "1024") == 1.0
    assert final_number_reward("-5", "-5") == 1.0 and final_number_reward("5", "-5") == 0.0


def test_generators_pose_the_answer_they_state():
    rng = random.Random(0)
    for _ in range(200):
        prompt, answer = make_sum(rng)
        a, b = (int(x) for x in prompt.removeprefix("What is ").split("?")[0].split(" + "))
        assert int(answer) == a + b
        prompt, answer = make_rows(rng)
        numbers = [int(w) for w in prompt.replace(".", " ").split() if w.isdigit()]
        assert len(numbers) == 2 and int(answer) == numbers[0] * numbers[1]


@pytest.mark.parametrize("name", ["chat_sums", "chat_rows"])
def test_chat_tasks_are_registered_text_tasks(name):
    task = get_task(name)
    assert task.vocabulary == "text" and task.split_key is not None
    row = dataset(name, 1, seed=0, split="train")[0]
    assert task.reward(f"The answer is {row['answer']}.", row["answer"]) == 1.0

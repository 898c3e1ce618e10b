"""Tasks for pretrained chat models (SmolLM2-135M-Instruct and up): arithmetic asked in words, scored by
the final number of the answer. Wordings vary, but each prompt's side of the held-out split is decided by
the problem it poses (its numbers), so no held-out problem is ever trained on in another wording.

Chosen with a written pilot (studies/llm_pilot.py -> docs/results/llm-pilot.md): both start between
10% and 60% correct at temperature 0.7, so groups have reward spread.
"""

from __future__ import annotations

import random
import re

from otbrl.tasks.builtin import Task

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")  # 1,024 -> 1024; "1,9" stays two numbers


def final_number_reward(completion: str, answer: str) -> float:
    """1.0 when the last number written in the completion equals the answer (thousands separators
    read), else 0.0."""
    numbers = _NUMBER.findall(_THOUSANDS.sub("", completion))
    return float(bool(numbers) and float(numbers[-1]) == float(answer))


def problem_key(prompt: str) -> str:
    """The numbers a prompt poses, in increasing order: `7 + 12` and `12 + 7` are one problem."""
    return ",".join(sorted(_NUMBER.findall(prompt), key=float))


def make_sum(rng: random.Random) -> tuple[str, str]:
    """`"What is 7 + 12? Reply with the number only."` -> `"19"`: two numbers 0-29."""
    a, b = rng.randint(0, 29), rng.randint(0, 29)
    return f"What is {a} + {b}? Reply with the number only.", str(a + b)


_ITEMS = ("eggs", "apples", "cookies", "stamps", "cups", "books", "plants", "chairs")
_HOLDERS = (
    "A box holds {a} rows of {b} {item}.",
    "A shelf has {a} rows with {b} {item} in each row.",
    "There are {a} bags with {b} {item} in each bag.",
)


def make_rows(rng: random.Random) -> tuple[str, str]:
    """`"A box holds 6 rows of 9 eggs. How many eggs are there in all?"` -> `"54"`: two numbers 2-12,
    three wordings, eight objects. The model reasons in words before its answer, at lengths it chooses."""
    a, b = rng.randint(2, 12), rng.randint(2, 12)
    item = rng.choice(_ITEMS)
    setting = rng.choice(_HOLDERS).format(a=a, b=b, item=item)
    return f"{setting} How many {item} are there in all?", str(a * b)


CHAT_TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task(
            name="chat_sums",
            description="add two numbers 0-29, answer with the number only (the quick demo)",
            max_completion_tokens=32,
            make=make_sum,
            reward=final_number_reward,
            heldout_fraction=0.3,
            split_key=problem_key,
            vocabulary="text",
        ),
        Task(
            name="chat_rows",
            description="rows of objects: multiply two numbers 2-12 asked in words; the model reasons "
            "before its answer and chooses its length (the reasoning task for the evidence)",
            max_completion_tokens=128,
            make=make_rows,
            reward=final_number_reward,
            heldout_fraction=0.3,
            split_key=problem_key,
            vocabulary="text",
        ),
    )
}

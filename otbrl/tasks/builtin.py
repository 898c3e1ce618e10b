"""Synthetic tasks with exactly verifiable answers, sized for tiny character-level models.

A `Task` makes (prompt, answer) string pairs from a `random.Random` and scores a completion against the
answer. `TASKS` is the registry; `dataset` gives TRL-style rows `{"prompt", "answer"}`.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from dataclasses import dataclass

from otbrl.tasks.tokenizer import EOS


@dataclass(frozen=True)
class Task:
    """A verifiable task.

    `make(rng) -> (prompt, answer)`; `reward(completion, answer) -> 1.0 | 0.0`. `max_completion_tokens`
    is enough for the longest answer plus the end-of-sequence token (tool output included).

    A task that uses tools (`otbrl.rollout.multiturn`) names them in `tools` and gives `demonstrate(prompt,
    answer, rng) -> [(text, trained), ...]`: a supervised warm start's target, split into the model's
    own text (trained) and tool output (not trained).
    """

    name: str
    description: str
    max_completion_tokens: int
    make: Callable[[random.Random], tuple[str, str]]
    reward: Callable[[str, str], float]
    tools: tuple[str, ...] = ()
    max_turns: int = 0
    demonstrate: Callable[[str, str, random.Random], list[tuple[str, bool]]] | None = None

    def score(self, prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
        """Rewards of a batch, in the form `otbrl.rollout.evaluate` takes."""
        return [self.reward(c, a) for c, a in zip(completions, answers, strict=True)]


def clean(completion: str) -> str:
    """What rewards compare: the completion cut at the first `<eos>` (in case the caller decoded special
    tokens) with surrounding whitespace stripped. Whitespace inside is kept, so it makes the answer wrong."""
    return completion.split(EOS, 1)[0].strip()


def exact_match(completion: str, answer: str) -> float:
    """1.0 if the cleaned completion equals the answer, else 0.0."""
    return float(clean(completion) == answer)


# ---------------------------------------------------------------------------------------------------------
# generators
# ---------------------------------------------------------------------------------------------------------


def make_add_reversed(rng: random.Random) -> tuple[str, str]:
    """`"964+494="` -> `"8541"`: two 3-digit numbers, their sum written least-significant digit first."""
    a, b = rng.randint(100, 999), rng.randint(100, 999)
    return f"{a}+{b}=", str(a + b)[::-1]


def make_reverse(rng: random.Random) -> tuple[str, str]:
    """`"abcdef:"` -> `"fedcba"`: 6 to 10 lowercase letters, reversed."""
    word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(6, 10)))
    return f"{word}:", word[::-1]


def running_sum_answer(digits: str) -> str:
    """`"3941"` -> `"3272;2"`: the running sums mod 10 (one per digit), `;`, the final sum mod 10."""
    total, chain = 0, []
    for d in digits:
        total = (total + int(d)) % 10
        chain.append(str(total))
    return "".join(chain) + ";" + str(total)


def make_running_sum(n: int) -> Callable[[random.Random], tuple[str, str]]:
    """Generator of `n` random digits then `:`; the answer is `running_sum_answer` of the digits."""

    def make(rng: random.Random) -> tuple[str, str]:
        digits = "".join(rng.choices(string.digits, k=n))
        return f"{digits}:", running_sum_answer(digits)

    make.__name__ = f"make_running_sum{n}"
    return make


def running_sum_reward(completion: str, answer: str) -> float:
    """Outcome-only reward: 1.0 iff the text after the last `;` is exactly the final digit of `answer`.
    The chain of running sums before it is the model's scratchpad and is not checked."""
    _, sep, tail = clean(completion).rpartition(";")
    return float(bool(sep) and tail == answer.rpartition(";")[2])


def running_sum_dense(completion: str, answer: str) -> float:
    """Partial credit in [0, 1]: the fraction of the answer's characters (chain, `;`, final digit) matched
    position by position. Not used by the registered tasks; useful for diagnostics and shaping."""
    text = clean(completion)
    hits = sum(a == b for a, b in zip(text, answer, strict=False))
    return hits / max(len(answer), len(text))  # extra characters count against


def make_product3(rng: random.Random) -> tuple[str, str]:
    """`"37*482*91="` -> `"1622894"`: a 2-digit, a 3-digit and a 2-digit number multiplied. Far beyond
    what a tiny model computes in its head; easy with a calculator and two calls."""
    a, b, c = rng.randint(10, 99), rng.randint(100, 999), rng.randint(10, 99)
    return f"{a}*{b}*{c}=", str(a * b * c)


def demonstrate_product3(prompt: str, answer: str, rng: random.Random) -> list[tuple[str, bool]]:
    """Most demonstrations multiply with two `calc` calls; some (30%) answer directly, as a model that
    has not learned to rely on the tool would, so the warm start calls the tool only sometimes."""
    a, b, c = prompt.rstrip("=").split("*")
    if rng.random() < 0.3:
        return [(answer, True)]
    ab = str(int(a) * int(b))
    return [
        (f"calc({a}*{b})", True), (f":{ab};", False),
        (f"calc({ab}*{c})", True), (f":{answer};", False),
        (answer, True),
    ]  # fmt: skip


def tool_answer_reward(completion: str, answer: str) -> float:
    """1.0 iff the text after the last tool output (`:...;`) is exactly the answer."""
    return float(clean(completion).rpartition(";")[2] == answer)


# ---------------------------------------------------------------------------------------------------------
# registry
# ---------------------------------------------------------------------------------------------------------


def _running_sum_task(n: int) -> Task:
    return Task(
        name=f"running_sum{n}",
        description=f"{n} digits then ':'; answer the running sums mod 10, ';', the final sum "
        "(only the final digit is rewarded)",
        max_completion_tokens=n + 3,  # chain + ';' + digit + <eos>
        make=make_running_sum(n),
        reward=running_sum_reward,
    )


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task(
            name="add_reversed",
            description="3-digit addition, sum written reversed: '964+494=' -> '8541'",
            max_completion_tokens=5,  # up to 4 digits + <eos>
            make=make_add_reversed,
            reward=exact_match,
        ),
        Task(
            name="reverse",
            description="reverse 6-10 lowercase letters: 'abcdef:' -> 'fedcba'",
            max_completion_tokens=11,  # up to 10 letters + <eos>
            make=make_reverse,
            reward=exact_match,
        ),
        _running_sum_task(16),
        _running_sum_task(48),
        Task(
            name="tir_product3",
            description="multiply three numbers with a calculator tool: '37*482*91=' -> "
            "'calc(37*482):17834;calc(17834*91):1622894;1622894' (tool output in ':...;', not trained)",
            max_completion_tokens=64,
            make=make_product3,
            reward=tool_answer_reward,
            tools=("calc",),
            max_turns=3,
            demonstrate=demonstrate_product3,
        ),
    )
}


def get_task(task: str | Task) -> Task:
    """A task by name (or the task itself); `ValueError` listing the known names otherwise."""
    if isinstance(task, Task):
        return task
    if task not in TASKS:
        raise ValueError(f"task: unknown {task!r}; known: {sorted(TASKS)}")
    return TASKS[task]


def dataset(task: str | Task, n: int, seed: int = 0) -> list[dict[str, str]]:
    """`n` rows `{"prompt": ..., "answer": ...}`, the same for the same (task name, n, seed)."""
    task = get_task(task)
    rng = random.Random(f"{task.name}:{seed}")  # str seeds are hashed with sha512: stable across runs
    rows = []
    for _ in range(n):
        prompt, answer = task.make(rng)
        rows.append({"prompt": prompt, "answer": answer})
    return rows

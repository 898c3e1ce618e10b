"""Synthetic tasks with exactly verifiable answers, sized for tiny character-level models.

A `Task` makes (prompt, answer) string pairs from a `random.Random` and scores a completion against the
answer. `TASKS` is the registry; `dataset` gives TRL-style rows `{"prompt", "answer"}`.
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Callable
from dataclasses import dataclass

from otbrl.tasks.split import Split, draw
from otbrl.tasks.tokenizer import EOS


@dataclass(frozen=True)
class Task:
    """A verifiable task.

    `make(rng) -> (prompt, answer)`; `reward(completion, answer) -> 1.0 | 0.0`. `max_completion_tokens`
    is enough for the longest answer plus the end-of-sequence token (tool output included).

    A task that uses tools (`otbrl.rollout.multiturn`) names them in `tools` and gives `demonstrate(prompt,
    answer, rng) -> [(text, trained), ...]`: a supervised warm start's target, split into the model's
    own text (trained) and tool output (not trained). A task whose tools hold an environment's state
    gives `episode(seed, prompt) -> {name: tool}` instead: a fresh toolbox for each completion.
    """

    name: str
    description: str
    max_completion_tokens: int
    make: Callable[[random.Random], tuple[str, str]]
    reward: Callable[[str, str], float]
    tools: tuple[str, ...] = ()
    max_turns: int = 0
    demonstrate: Callable[[str, str, random.Random], list[tuple[str, bool]]] | None = None
    episode: Callable[[int, str], dict[str, Callable[[str], str]]] | None = None
    # The share of the prompt space held out from training (`otbrl.tasks.split`): `dataset(split=...)`.
    heldout_fraction: float = 0.25
    split_key: Callable[[str], str] | None = None  # the problem a prompt poses (default: the prompt)
    # "char": written in the tiny models' character vocabulary (`otbrl.tasks.tokenizer`); "text": natural
    # language for a pretrained model's own tokenizer (`otbrl.tasks.chat`)
    vocabulary: str = "char"
    # Every problem key (`split_key`'s values) where the space is enumerable: tests and pilots count the
    # held-out problems exactly instead of estimating them from draws (`otbrl.tasks.chat_problems`).
    problems: Callable[[], frozenset[str]] | None = None

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
        (f"calc({a}*{b})", True),
        (f":{ab};", False),
        (f"calc({ab}*{c})", True),
        (f":{answer};", False),
        (answer, True),
    ]


def tool_answer_reward(completion: str, answer: str) -> float:
    """1.0 iff the text after the last tool output (`:...;`) is exactly the answer."""
    return float(clean(completion).rpartition(";")[2] == answer)


# A walk on the number line 00..99 whose length is the policy's choice: the answer is any walk of unit
# steps from the start to the target, so detours make a completion long, and (for a model that slips
# now and then) likely wrong or cut off by the token budget.
WALK_MIN_DISTANCE, WALK_MAX_DISTANCE = 8, 28
WALK_MAX_TOKENS = 240  # completion budget, eos included: 79 positions at 3 characters each + eos
WALK_DETOUR = 0.5  # share of demonstrations that wander; the rest walk straight to the target
WALK_BACK, WALK_BACK_AGAIN = 0.15, 0.6  # a wanderer's chance of a step away, after a forward / a back step


def make_walk(rng: random.Random) -> tuple[str, str]:
    """`"37 to 52:"` -> `"37,38,...,52."`: two positions in 00..99, 8 to 28 apart; the answer is the
    direct walk, start and target included (two digits a position, `,` between, `.` at the end)."""
    distance = rng.randint(WALK_MIN_DISTANCE, WALK_MAX_DISTANCE)
    low = rng.randint(0, 99 - distance)
    start, target = (low, low + distance) if rng.random() < 0.5 else (low + distance, low)
    step = 1 if target > start else -1
    return f"{start:02d} to {target:02d}:", format_walk(list(range(start, target + step, step)))


def walk_pair(prompt: str) -> str:
    """The unordered endpoints of a walk prompt (`"52 to 37:"` -> `"37-52"`): a walk and its reversal pose
    one problem for the split, so no held-out walk has its reversal trained on (`walk_pairs`)."""
    a, _, b = prompt.rstrip(":").partition(" to ")
    return "-".join(sorted((a, b)))


def format_walk(positions: list[int]) -> str:
    """`[37, 38, 37]` -> `"37,38,37."`."""
    return ",".join(f"{p:02d}" for p in positions) + "."


def parse_walk(text: str) -> list[int] | None:
    """The positions of a well-formed walk text (`format_walk`'s output), else None."""
    if not re.fullmatch(r"\d\d(,\d\d)*\.", text):
        return None
    return [int(p) for p in text[:-1].split(",")]


def walk_reward(completion: str, answer: str) -> float:
    """Outcome-only reward: 1.0 iff the completion is a well-formed walk that begins at the answer's
    first position (the start), moves by exactly 1 each step and ends at the answer's last (the target).
    Detours and passing through the target on the way are allowed; a walk cut off by the budget has no
    final `.` and earns 0."""
    walk, ref = parse_walk(clean(completion)), parse_walk(answer)
    if ref is None:
        raise ValueError(f"answer: not a walk: {answer!r}")
    if walk is None or walk[0] != ref[0] or walk[-1] != ref[-1]:
        return 0.0
    return float(all(abs(b - a) == 1 for a, b in zip(walk, walk[1:], strict=False)))


def wandering_walk(start: int, target: int, rng: random.Random) -> list[int]:
    """A walk from `start` to `target` inside 00..99 that steps away from the target with probability
    `WALK_BACK` after a step towards it and `WALK_BACK_AGAIN` after a step away (so detours come in
    runs: long-tailed lengths), stopping at the first visit of the target."""
    positions, back = [start], False
    while positions[-1] != target:
        here = positions[-1]
        toward = 1 if target > here else -1
        back = rng.random() < (WALK_BACK_AGAIN if back else WALK_BACK) and 0 <= here - toward <= 99
        positions.append(here - toward if back else here + toward)
    return positions


def demonstrate_walk(prompt: str, answer: str, rng: random.Random) -> list[tuple[str, bool]]:
    """A warm start's target: the direct walk (`answer`) half the time, otherwise a wandering walk
    (`wandering_walk`) that fits the token budget, so the imitating policy's lengths vary widely for
    one prompt. Every demonstration earns `walk_reward` 1."""
    ref = parse_walk(answer)
    if ref is None:
        raise ValueError(f"answer: not a walk: {answer!r}")
    if rng.random() < WALK_DETOUR:
        for _ in range(20):  # resample the rare walk too long for the budget
            walk = wandering_walk(ref[0], ref[-1], rng)
            if 3 * len(walk) + 1 <= WALK_MAX_TOKENS:
                return [(format_walk(walk), True)]
    return [(answer, True)]


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
        Task(
            name="walk",
            description="walk the number line from start to target in unit steps: '37 to 52:' -> "
            "'37,38,...,52.' (any walk counts; demonstrations half wander, so lengths vary: 9-240 tokens)",
            max_completion_tokens=WALK_MAX_TOKENS,
            make=make_walk,
            reward=walk_reward,
            demonstrate=demonstrate_walk,
            # 3,444 prompts in all: 1,142 held out, so an evaluation can score 1,024 distinct held-out
            # prompts (0.25 would leave 900)
            heldout_fraction=0.32,
        ),
        Task(
            name="walk_pairs",
            description="walk, with a walk and its reversal on the same side of the held-out split (the "
            "split is keyed on the unordered endpoints), so no held-out walk's reversal is trained on",
            max_completion_tokens=WALK_MAX_TOKENS,
            make=make_walk,
            reward=walk_reward,
            demonstrate=demonstrate_walk,
            # 1,722 endpoint pairs, 3,444 prompts: about 36% held out leaves >= 1,024 distinct prompts
            heldout_fraction=0.36,
            split_key=walk_pair,
            problems=lambda: frozenset(
                f"{a:02d}-{a + d:02d}"
                for d in range(WALK_MIN_DISTANCE, WALK_MAX_DISTANCE + 1)
                for a in range(100 - d)
            ),
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


def dataset(
    task: str | Task, n: int, seed: int = 0, split: Split | None = None, distinct_problems: bool = False
) -> list[dict[str, str]]:
    """`n` rows `{"prompt": ..., "answer": ...}`, the same for the same (task name, n, seed, split).

    `split="train"` or `"heldout"` draws only from that side of the task's hash split of its prompt space
    (`otbrl.tasks.split`, `task.heldout_fraction` held out), so the two never share a prompt; None draws
    from the whole space. Held-out rows are `n` distinct prompts (an evaluation of n prompts scores n
    prompts, not repeats); a held-out side smaller than `n` is a `ValueError`. Training rows repeat freely.
    `distinct_problems`: held-out rows are `n` distinct problems (`task.split_key`), each in one wording,
    so that n rows are n independent units of an evaluation, not a few problems worded n ways."""
    task = get_task(task)
    rng = random.Random(f"{task.name}:{seed}")  # str seeds are hashed with sha512: stable across runs
    make = lambda: task.make(rng)  # noqa: E731
    rows: list[dict[str, str]] = []
    seen: set[str] = set()
    misses = 0
    while len(rows) < n:
        prompt, answer = (
            make()
            if split is None
            else draw(make, split, task.heldout_fraction, task.name, key=task.split_key)
        )
        key = task.split_key(prompt) if distinct_problems and task.split_key else prompt
        if split == "heldout" and key in seen:
            misses += 1
            if misses > 50 * n + 10_000:  # coupon collecting the last prompts of a side takes ~ln(size) x
                units = "problems" if distinct_problems else "prompts"
                raise ValueError(
                    f"eval_size: {n} distinct held-out {units} asked of task {task.name}, but its held-out "
                    f"side (heldout_fraction {task.heldout_fraction}) gave only {len(rows)}"
                )
            continue
        seen.add(key)
        rows.append({"prompt": prompt, "answer": answer})
    return rows

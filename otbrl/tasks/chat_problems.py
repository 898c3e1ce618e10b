"""Chat tasks with large, enumerable problem spaces (issue 34): small arithmetic asked in several wordings,
where the length of the working varies with the problem (two to five numbers to add, one- or two-step unit
conversions, one to three changes in a story) and with how much the model chooses to write.

Each family is a problem (a tuple of numbers, and for units the conversion), a set of wordings that pose
it, its answer, and the key that names it. The key is read back from the prompt text, so `Task.split_key`
puts every wording of one problem on the same side of the hash split: a held-out problem is never trained
on in any wording. Where the numbers' order does not change the problem (sums, stories), the key is the
sorted numbers, which also puts reorderings of one sum on one side. `Task.problems` enumerates every key,
so tests and pilots can count the held-out problems instead of estimating them.

The candidates are compared in studies/llm_pilot2.py, llm_pilot3.py and llm_pilot4.py (their pages in
docs/results/).
"""

from __future__ import annotations

import itertools
import random
import re
from collections.abc import Callable
from functools import cache

from otbrl.tasks.builtin import Task
from otbrl.tasks.chat import final_number_reward, problem_key
from otbrl.tasks.chat_draws import (
    MAX_TOKENS,
    MOST_DRAWS,
    demonstrate_draws,
    demonstrate_draws_told,
    draws_key,
    draws_problems,
    draws_reward,
    episode,
    episode_told,
    make_draws,
)
from otbrl.tasks.worked import demonstrate_sum

# ---------------------------------------------------------------------------------------------------------
# sums of several one-digit numbers
# ---------------------------------------------------------------------------------------------------------

ADD_TERMS = (2, 5)  # how many numbers to add: the working grows with the count
ADD_DIGITS = (1, 9)


def draw_terms(rng: random.Random) -> list[int]:
    """Two to five numbers 1-9, the count drawn first (so five-number sums are not most of the draws)."""
    return [rng.randint(*ADD_DIGITS) for _ in range(rng.randint(*ADD_TERMS))]


def spoken_list(numbers: list[int]) -> str:
    """`[3, 8, 5]` -> `"3, 8 and 5"`."""
    words = [str(n) for n in numbers]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


_ADD_WORDINGS: tuple[Callable[[list[int]], str], ...] = (
    lambda t: f"What is {' + '.join(map(str, t))}?",
    lambda t: f"Add {spoken_list(t)}.",
    lambda t: f"What is the sum of {spoken_list(t)}?",
    lambda t: f"What do {spoken_list(t)} add up to?",
)
ADD_WORK = " Add the numbers one at a time, then give the total."


def pose_sum(terms: list[int], wording: int) -> str:
    return _ADD_WORDINGS[wording](terms)


def make_addlist(rng: random.Random) -> tuple[str, str]:
    """`"What is 3 + 8 + 5?"` -> `"16"`: two to five numbers 1-9, four wordings, the numbers in the order
    drawn."""
    terms = draw_terms(rng)
    return pose_sum(terms, rng.randrange(len(_ADD_WORDINGS))), str(sum(terms))


def make_addlist_work(rng: random.Random) -> tuple[str, str]:
    """`make_addlist`'s problems, asking for the working: `"Add 3, 8 and 5. Add the numbers one at a
    time, then give the total."` -> `"16"`."""
    prompt, answer = make_addlist(rng)
    return prompt + ADD_WORK, answer


_NAMES = (("Mia", "she"), ("Tom", "he"), ("Sara", "she"), ("Ben", "he"), ("Lena", "she"), ("Omar", "he"))
_FINDS = (("picks", "pick"), ("collects", "collect"), ("finds", "find"), ("buys", "buy"))
_THINGS = ("apples", "shells", "stamps", "marbles", "cards", "stones")


def pose_basket(terms: list[int], wording: int, rng: random.Random) -> str:
    name, pronoun = rng.choice(_NAMES)
    verb, base = rng.choice(_FINDS)
    thing = rng.choice(_THINGS)
    if wording == 0:
        runs = f"{terms[0]} {thing}, " + ", ".join(f"then {n} more" for n in terms[1:])
        return f"{name} {verb} {runs}. How many {thing} does {pronoun} {base} in all?"
    return f"{name} has bags with {spoken_list(terms)} {thing} in them. How many {thing} are there in all?"


def make_basket(rng: random.Random) -> tuple[str, str]:
    """`"Mia picks 3 apples, then 8 more, then 5 more. How many apples does she pick in all?"` -> `"16"`:
    `make_addlist`'s problems told as a story (two wordings, six names, four verbs, six objects)."""
    terms = draw_terms(rng)
    return pose_basket(terms, rng.randrange(2), rng), str(sum(terms))


@cache
def sum_problems() -> frozenset[str]:
    """Every problem key of the sum tasks: the multisets of two to five numbers 1-9 (1,992)."""
    digits = range(ADD_DIGITS[0], ADD_DIGITS[1] + 1)
    return frozenset(
        ",".join(map(str, c))
        for k in range(ADD_TERMS[0], ADD_TERMS[1] + 1)
        for c in itertools.combinations_with_replacement(digits, k)
    )


# ---------------------------------------------------------------------------------------------------------
# unit conversions, one or two steps
# ---------------------------------------------------------------------------------------------------------

# (larger unit, its singular, smaller unit, its singular, how many smaller in one larger)
CONVERSIONS: tuple[tuple[str, str, str, str, int], ...] = (
    ("hours", "hour", "minutes", "minute", 60),
    ("minutes", "minute", "seconds", "second", 60),
    ("days", "day", "hours", "hour", 24),
    ("weeks", "week", "days", "day", 7),
    ("years", "year", "months", "month", 12),
    ("feet", "foot", "inches", "inch", 12),
    ("metres", "metre", "centimetres", "centimetre", 100),
    ("kilograms", "kilogram", "grams", "gram", 1000),
    ("dollars", "dollar", "cents", "cent", 100),
)
UNIT_ONE_STEP = (2, 30)  # "How many minutes are in 7 hours?"
UNIT_TWO_STEP = (1, 9)  # "How many minutes are in 3 hours and 15 minutes?": then 1..min(factor - 1, 59)
UNIT_REST_MAX = 59
_UNIT_NAMES = {name: plural for c in CONVERSIONS for plural, name in ((c[0], c[0]), (c[0], c[1]))} | {
    name: plural for c in CONVERSIONS for plural, name in ((c[2], c[2]), (c[2], c[3]))
}
_PAIRS = {frozenset((c[0], c[2])): i for i, c in enumerate(CONVERSIONS)}
_WORD = re.compile(r"[a-z]+")


def _count(n: int, plural: str, singular: str) -> str:
    return f"{n} {singular if n == 1 else plural}"


def pose_units(conversion: int, numbers: tuple[int, ...], wording: int) -> str:
    big, big1, small, small1, _ = CONVERSIONS[conversion]
    amount = _count(numbers[0], big, big1)
    if len(numbers) == 2:
        amount += f" and {_count(numbers[1], small, small1)}"
    return (
        f"How many {small} are in {amount}?",
        f"Convert {amount} to {small}.",
        f"{amount[0].upper()}{amount[1:]} is how many {small}?",
    )[wording]


def draw_units(rng: random.Random) -> tuple[int, tuple[int, ...]]:
    """A conversion and its numbers: one step (2-30 of the larger unit) or two steps (1-9 of the larger
    unit and some of the smaller), each half the time."""
    conversion = rng.randrange(len(CONVERSIONS))
    if rng.random() < 0.5:
        return conversion, (rng.randint(*UNIT_ONE_STEP),)
    rest = rng.randint(1, min(CONVERSIONS[conversion][4] - 1, UNIT_REST_MAX))
    return conversion, (rng.randint(*UNIT_TWO_STEP), rest)


def solve_units(conversion: int, numbers: tuple[int, ...]) -> int:
    return numbers[0] * CONVERSIONS[conversion][4] + sum(numbers[1:])


def make_units(rng: random.Random) -> tuple[str, str]:
    """`"How many minutes are in 3 hours and 15 minutes?"` -> `"195"`: nine conversions (time, length,
    weight, money), one step or two, three wordings."""
    conversion, numbers = draw_units(rng)
    return pose_units(conversion, numbers, rng.randrange(3)), str(solve_units(conversion, numbers))


def units_key(prompt: str) -> str:
    """`"hours>minutes:3,15"`: the conversion (from the unit words, singular or plural) and the numbers in
    the order posed (3 hours and 15 minutes is not 15 hours and 3 minutes)."""
    units = frozenset(_UNIT_NAMES[w] for w in _WORD.findall(prompt.lower()) if w in _UNIT_NAMES)
    conversion = _PAIRS.get(units)
    if conversion is None:
        raise ValueError(f"prompt: no conversion of chat_units in {prompt!r}")
    big, _, small, _, _ = CONVERSIONS[conversion]
    return f"{big}>{small}:" + ",".join(re.findall(r"\d+", prompt))


@cache
def units_problems() -> frozenset[str]:
    """Every problem key of chat_units (3,375)."""
    keys = set()
    for big, _, small, _, factor in CONVERSIONS:
        keys |= {f"{big}>{small}:{n}" for n in range(UNIT_ONE_STEP[0], UNIT_ONE_STEP[1] + 1)}
        rests = range(1, min(factor - 1, UNIT_REST_MAX) + 1)
        keys |= {
            f"{big}>{small}:{n},{r}" for n in range(UNIT_TWO_STEP[0], UNIT_TWO_STEP[1] + 1) for r in rests
        }
    return frozenset(keys)


# ---------------------------------------------------------------------------------------------------------
# stories: a start and one to three changes
# ---------------------------------------------------------------------------------------------------------

STORY_START = (2, 20)
STORY_CHANGES = (1, 3)
STORY_STEP = (1, 9)
_GAINS = ("{p} buys {n} more.", "{p} finds {n} more.", "{p} gets {n} more from a friend.")
_LOSSES = ("{p} gives {n} away.", "{p} loses {n}.", "{p} sells {n}.")
_STORY_THINGS = ("apples", "marbles", "stickers", "pencils", "cookies", "cards")


def draw_story(rng: random.Random) -> tuple[int, list[int]]:
    """A start (2-20) and one to three changes of 1-9, each a gain or a loss; a loss never takes more
    than there is."""
    start = rng.randint(*STORY_START)
    total, changes = start, []
    for _ in range(rng.randint(*STORY_CHANGES)):
        n = rng.randint(*STORY_STEP)
        change = -n if rng.random() < 0.5 and n <= total else n
        changes.append(change)
        total += change
    return start, changes


def pose_story(start: int, changes: list[int], rng: random.Random) -> str:
    name, pronoun = rng.choice(_NAMES)
    thing = rng.choice(_STORY_THINGS)
    steps = []
    for i, change in enumerate(changes):
        text = rng.choice(_GAINS if change > 0 else _LOSSES).format(p=pronoun, n=abs(change))
        steps.append(("Then " + text[0].lower() + text[1:]) if i else text[0].upper() + text[1:])
    return f"{name} has {start} {thing}. {' '.join(steps)} How many {thing} does {name} have now?"


def make_story(rng: random.Random) -> tuple[str, str]:
    """`"Tom has 7 apples. He buys 5 more. Then he gives 3 away. How many apples does Tom have now?"`
    -> `"9"`: one, two or three changes (mixed one- and multi-step problems)."""
    start, changes = draw_story(rng)
    return pose_story(start, changes, rng), str(start + sum(changes))


@cache
def story_problems() -> frozenset[str]:
    """Every problem key of chat_story: the sorted numbers of every story `draw_story` can tell (a
    coarser key than the story itself: stories with the same numbers fall on one side together; 3,111)."""
    keys = set()
    steps = range(STORY_STEP[0], STORY_STEP[1] + 1)
    signed = [*steps, *(-n for n in steps)]

    def walk(total: int, numbers: tuple[int, ...], left: int) -> None:
        if len(numbers) > 1:
            keys.add(",".join(map(str, sorted(numbers))))
        if left == 0:
            return
        for change in signed:
            if total + change >= 0:
                walk(total + change, (*numbers, abs(change)), left - 1)

    for start in range(STORY_START[0], STORY_START[1] + 1):
        walk(start, (start,), STORY_CHANGES[1])
    return frozenset(keys)


# ---------------------------------------------------------------------------------------------------------
# the same problems after one worked example (issue 34's second pilot round)
# ---------------------------------------------------------------------------------------------------------

# Why: in the first pilot (docs/results/llm-pilot2.md) the model wrote off-topic text and got three or
# more numbers almost never right. One worked example before the question shows the working a step at a
# time, so the working's length grows with the problem's steps. The example is fixed and its numbers are
# not part of the problem: the keys read only the text after it.
EXAMPLE_BREAK = "\n\nNow: "
SUM_EXAMPLE = "Example: What is 2 + 6 + 1? Working: 2 + 6 = 8, then 8 + 1 = 9. The answer is 9."
STORY_EXAMPLE = (
    "Example: Ann has 5 pens. She buys 3 more. Then she loses 2. How many pens does Ann have now? "
    "Working: 5 + 3 = 8, then 8 - 2 = 6. The answer is 6."
)


def after_example(prompt: str) -> str:
    """The question a worked-example prompt asks (the whole prompt when it has no example)."""
    return prompt.rpartition(EXAMPLE_BREAK)[2]


def shown_key(prompt: str) -> str:
    """`problem_key` of the question after the worked example."""
    return problem_key(after_example(prompt))


def make_addlist_shown(rng: random.Random) -> tuple[str, str]:
    """`make_addlist`'s problems after one worked example: `"Example: What is 2 + 6 + 1? Working: ...
    The answer is 9.\n\nNow: What is 3 + 8 + 5?"` -> `"16"`."""
    prompt, answer = make_addlist(rng)
    return SUM_EXAMPLE + EXAMPLE_BREAK + prompt, answer


def make_story_shown(rng: random.Random) -> tuple[str, str]:
    """`make_story`'s problems after one worked example (a start, a gain and a loss)."""
    prompt, answer = make_story(rng)
    return STORY_EXAMPLE + EXAMPLE_BREAK + prompt, answer


# ---------------------------------------------------------------------------------------------------------
# two-number problems (issue 34's third pilot round)
# ---------------------------------------------------------------------------------------------------------

# Why: in pilots 2 and 3 (docs/results/llm-pilot2.md, llm-pilot3.md) the model solved only two-number sums
# at all (5-28% right); three or more numbers, unit conversions and multi-step stories were 0-9%. Two
# numbers 1-50 keep each problem one step while the space holds >= 1,000 problems (1,275 unordered pairs).
PAIR_RANGE = (1, 50)
_SUB_WORDINGS: tuple[Callable[[int, int], str], ...] = (
    lambda a, b: f"What is {a} - {b}?",
    lambda a, b: f"Subtract {b} from {a}.",
    lambda a, b: f"What is {a} minus {b}?",
    lambda a, b: f"Take {b} away from {a}. What is left?",
)
# The words that mark a difference in every two-number wording; no sum wording uses any of them (tested),
# so the key can read the operation back from the prompt.
_MINUS = re.compile(r"\d - \d|\b(?:minus|subtract|away|loses|sells|gave)\b", re.IGNORECASE)


def draw_pair(rng: random.Random) -> tuple[int, int]:
    """Two numbers 1-50, in the order drawn."""
    return rng.randint(*PAIR_RANGE), rng.randint(*PAIR_RANGE)


def make_pair(rng: random.Random) -> tuple[str, str]:
    """`"What is 23 + 38?"` -> `"61"`: chat_addlist's four wordings with two numbers 1-50."""
    a, b = draw_pair(rng)
    return pose_sum([a, b], rng.randrange(len(_ADD_WORDINGS))), str(a + b)


def pose_sub(a: int, b: int, wording: int) -> str:
    return _SUB_WORDINGS[wording](a, b)


def make_pair_mixed(rng: random.Random) -> tuple[str, str]:
    """`"What is 38 - 23?"` -> `"15"` or `"What is 23 + 38?"` -> `"61"`: a sum or a difference (each half
    the time) of two numbers 1-50, four wordings each; a difference never goes below zero."""
    a, b = draw_pair(rng)
    if rng.random() < 0.5:
        return pose_sum([a, b], rng.randrange(len(_ADD_WORDINGS))), str(a + b)
    big, small = max(a, b), min(a, b)
    return pose_sub(big, small, rng.randrange(len(_SUB_WORDINGS))), str(big - small)


def pose_pair_story(a: int, b: int, minus: bool, wording: int, rng: random.Random) -> str:
    """A one-step story: `a` and a gain of `b` (or a second person's `b`), or `a` and a loss of `b`."""
    (name, pronoun), (friend, _) = rng.sample(_NAMES, 2)
    thing = rng.choice(_STORY_THINGS)
    he = pronoun[0].upper() + pronoun[1:]
    now = f"How many {thing} does {name} have now?"
    if minus:
        return (
            f"{name} has {a} {thing}. {he} gives {b} away. {now}",
            f"{name} has {a} {thing}. {he} loses {b}. {now}",
            f"{name} has {a} {thing}. {he} sells {b}. {now}",
            f"{name} had {a} {thing} and gave {b} to {friend}. How many {thing} does {name} have left?",
        )[wording]
    return (
        f"{name} has {a} {thing}. {he} buys {b} more. {now}",
        f"{name} has {a} {thing}. {he} finds {b} more. {now}",
        f"{name} has {a} {thing}. {he} gets {b} more from {friend}. {now}",
        f"{name} has {a} {thing} and {friend} has {b} {thing}. How many {thing} do they have together?",
    )[wording]


def make_pair_story(rng: random.Random) -> tuple[str, str]:
    """`"Tom has 23 marbles. He gives 8 away. How many marbles does Tom have now?"` -> `"15"`: one gain
    or one loss (each half the time) of two numbers 1-50, four wordings each; a loss never takes more than
    there is."""
    a, b = draw_pair(rng)
    if rng.random() < 0.5:
        return pose_pair_story(a, b, False, rng.randrange(4), rng), str(a + b)
    big, small = max(a, b), min(a, b)
    return pose_pair_story(big, small, True, rng.randrange(4), rng), str(big - small)


def signed_key(prompt: str) -> str:
    """`"-:23,38"` / `"+:23,38"`: the operation (read from the wording's words) and the sorted numbers.
    A sum and a difference of the same numbers are different problems; a difference's order is fixed
    (the larger number first), so sorting loses nothing."""
    return ("-:" if _MINUS.search(prompt) else "+:") + problem_key(prompt)


def _pairs() -> list[tuple[int, int]]:
    return list(itertools.combinations_with_replacement(range(PAIR_RANGE[0], PAIR_RANGE[1] + 1), 2))


@cache
def pair_problems() -> frozenset[str]:
    """Every problem key of chat_pair: the unordered pairs of numbers 1-50 (1,275)."""
    return frozenset(f"{a},{b}" for a, b in _pairs())


@cache
def signed_pair_problems() -> frozenset[str]:
    """Every problem key of chat_pair_mixed and chat_pair_story: each pair's sum and difference (2,550)."""
    return frozenset(f"{op}:{a},{b}" for a, b in _pairs() for op in "+-")


# ---------------------------------------------------------------------------------------------------------
# registry
# ---------------------------------------------------------------------------------------------------------

_MAX_TOKENS = 128


def _task(
    name: str, description: str, make: Callable, key: Callable, problems: Callable, worked: bool = False
) -> Task:
    """A chat problem task; `worked`: its prompts pose a plain sum, so it has worked solutions for a
    supervised warm start (`otbrl.tasks.worked`, `otbrl sft`)."""
    return Task(
        name=name,
        description=description,
        max_completion_tokens=_MAX_TOKENS,
        make=make,
        reward=final_number_reward,
        heldout_fraction=0.3,
        split_key=key,
        vocabulary="text",
        problems=problems,
        demonstrate=demonstrate_sum if worked else None,
    )


def _draws_task(name: str, description: str, demonstrate: Callable, episode: Callable) -> Task:
    """A multi-turn draws task (`otbrl.tasks.chat_draws`): its tool holds each completion's own deck."""
    return Task(
        name=name,
        description=description,
        max_completion_tokens=MAX_TOKENS,
        make=make_draws,
        reward=draws_reward,
        tools=("draw",),
        max_turns=MOST_DRAWS,
        demonstrate=demonstrate,
        episode=episode,
        heldout_fraction=0.3,
        split_key=draws_key,
        vocabulary="text",
        problems=draws_problems,
    )


PROBLEM_TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        _task(
            "chat_addlist",
            "add two to five numbers 1-9 ('What is 3 + 8 + 5?'); 1,992 problems",
            make_addlist,
            problem_key,
            sum_problems,
            worked=True,
        ),
        _task(
            "chat_addlist_work",
            "chat_addlist asking for the working ('... Add the numbers one at a time, then give the total.')",
            make_addlist_work,
            problem_key,
            sum_problems,
            worked=True,
        ),
        _task(
            "chat_basket",
            "chat_addlist's sums told as a story ('Mia picks 3 apples, then 8 more, then 5 more. ...')",
            make_basket,
            problem_key,
            sum_problems,
            worked=True,
        ),
        _task(
            "chat_units",
            "unit conversions in one or two steps ('How many minutes are in 3 hours and 15 minutes?')",
            make_units,
            units_key,
            units_problems,
        ),
        _task(
            "chat_addlist_shown",
            "chat_addlist after one worked example ('Example: What is 2 + 6 + 1? Working: 2 + 6 = 8, ...')",
            make_addlist_shown,
            shown_key,
            sum_problems,
        ),
        _task(
            "chat_story_shown",
            "chat_story after one worked example ('Example: Ann has 5 pens. ... Working: 5 + 3 = 8, ...')",
            make_story_shown,
            shown_key,
            story_problems,
        ),
        _task(
            "chat_story",
            "a start and one to three gains or losses ('Tom has 7 apples. He buys 5 more. Then ...')",
            make_story,
            problem_key,
            story_problems,
        ),
        _task(
            "chat_pair",
            "add two numbers 1-50 in chat_addlist's four wordings ('What is 23 + 38?'); 1,275 problems",
            make_pair,
            problem_key,
            pair_problems,
            worked=True,
        ),
        _task(
            "chat_pair_mixed",
            "a sum or a difference of two numbers 1-50 ('What is 38 - 23?'); 2,550 problems",
            make_pair_mixed,
            signed_key,
            signed_pair_problems,
        ),
        _draws_task(
            "chat_draws",
            "draw numbers with a tool until one is large enough, keeping a running total "
            "('Start with 12. Call draw() ... Stop after the first draw of 6 or more ...'): the environment "
            "sets how many draws an answer takes; 1,080 problems",
            demonstrate_draws,
            episode,
        ),
        _draws_task(
            "chat_draws_told",
            "chat_draws with each draw saying whether it stops ('draw():7 stop;', 'draw():3 "
            "more;'): the model reads the rule's verdict instead of comparing numbers; 1,080 problems "
            "(its own hash split: 323 held out)",
            demonstrate_draws_told,
            episode_told,
        ),
        _task(
            "chat_pair_story",
            "one gain or loss of two numbers 1-50 ('Tom has 23 marbles. He gives 8 away. ...'); 2,550 "
            "problems",
            make_pair_story,
            signed_key,
            signed_pair_problems,
        ),
    )
}

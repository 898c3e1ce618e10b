"""A multi-turn chat task whose answers keep differing in length while the model learns (issue 34): draw
numbers with a tool until one is large enough, keeping a running total.

    Start with 12. Call draw() to get a number from 1 to 8 and add it. Stop after the first draw of 6 or
    more and give the total.
    -> draw():3; 12 + 3 = 15. draw():7; 15 + 7 = 22. The total is 22.

How many draws an answer needs is the environment's, not the model's: `draw()` is a tool with its own
random state for each completion (`episode`, an `otbrl.rollout.multiturn.Episode`), so the samples of one
prompt meet different draws and stop after different numbers of them (geometric, 1 in 3 to 1 in 2 draws
stops). On the single-turn sum tasks the model chose the length of its working, and RL removed the choice
within a few steps: within-group length CV fell from about 0.4 to below 0.1 on chat_addlist_work
(docs/results/runs/smollm2b-pilot/). Here no policy can remove it; the model learns to add and to stop.

A problem is (start, top, stop): the start 1-90, draws 1..top, stop at a draw >= stop, where one draw in
three to one in two stops (12 pairs of top and stop, 1,080 problems). The episode's `MOST_DRAWS`-th draw
always stops, so an answer needs at most `MOST_DRAWS` calls, the task's `max_turns`: a right answer
never runs out of calls, and a draw the model writes itself after them (no tool output) cannot pass.

Reward (`draws_reward`): 1.0 when the completion's tool outputs (`draw():N;`, every call counted) stop at
the first draw >= stop (none before it, none after it) and the last number written after the last draw (as
chat tasks read numbers: decimals and thousands separators too) is start + the sum of the draws; else
0.0. The answer string is `"start 12, 1-8, stop 6"` (a task's reward sees only completion and answer).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from functools import cache

from otbrl.tasks.chat import final_number_reward

# otbrl.rollout.multiturn's markers around a tool's output (not imported: tasks stay free of transformers)
OUTPUT_START, OUTPUT_END = ":", ";"

START = (1, 90)
# (top, stop): draws 1..top, a draw >= stop ends the episode with probability (top - stop + 1) / top
RULES = ((6, 4), (6, 5), (7, 5), (8, 5), (8, 6), (9, 6), (9, 7), (10, 6), (10, 7), (12, 7), (12, 8), (12, 9))
MOST_DRAWS = 8  # the 8th draw always stops (the task's max_turns); 1 episode in 17 (p = 1/3) to 1 in 128
# (p = 1/2) gets that far
MAX_TOKENS = 192  # 8 draws of about 15 tokens (call, output, one addition) and the closing sentence
CALL = "draw()"

_WORDINGS = (
    "Start with {s}. Call draw() to get a number from 1 to {m} and add it. Stop after the first draw of {k} "
    "or more and give the total.",
    "You have {s} points. Each draw() gives a number from 1 to {m}; add it to your points. Keep drawing "
    "until you draw {k} or more, then give your points.",
    "Begin at {s}. draw() returns a number from 1 to {m}: add each one. Once a draw is {k} or more, stop "
    "and say the sum.",
)
_START = re.compile(r"(?:Start with|You have|Begin at) (\d+)")
_TOP = re.compile(r"from 1 to (\d+)")
_STOP = re.compile(r"(\d+) or more")
# a call and its output: `draw():7;`, or `draw()::7;` when the model's token closing the call carried a
# colon (the rollout still runs the tool there and appends its output)
_DRAW = re.compile(
    rf"(?<![A-Za-z0-9_])draw\([^()]*\){OUTPUT_START}?{OUTPUT_START}(\d+)(?: stop| more)?{OUTPUT_END}"
)  # chat_draws_told's outputs say `7 stop` or `3 more`
_ANSWER = re.compile(r"start (\d+), 1-(\d+), stop (\d+)")


@cache
def _problems() -> tuple[tuple[int, int, int], ...]:
    return tuple((s, m, k) for m, k in RULES for s in range(START[0], START[1] + 1))


def parse_prompt(prompt: str) -> tuple[int, int, int]:
    """(start, top, stop) of a prompt in any wording (the last match of each: a chat template or system
    prompt before it does not count)."""
    found = [p.findall(prompt) for p in (_START, _TOP, _STOP)]
    if not all(found):
        raise ValueError(f"not a draws problem (start, 1 to top, stop or more): {prompt[-200:]!r}")
    return int(found[0][-1]), int(found[1][-1]), int(found[2][-1])


def draws_key(prompt: str) -> str:
    """The problem a prompt poses: `"start,top,stop"`."""
    return ",".join(map(str, parse_prompt(prompt)))


def draws_problems() -> frozenset[str]:
    """Every problem key (1,080)."""
    return frozenset(f"{s},{m},{k}" for s, m, k in _problems())


def pose_draws(start: int, top: int, stop: int, wording: int) -> str:
    return _WORDINGS[wording].format(s=start, m=top, k=stop)


def make_draws(rng: random.Random) -> tuple[str, str]:
    """A problem drawn uniformly from the space in one of three wordings, and its answer string."""
    s, m, k = rng.choice(_problems())
    return pose_draws(s, m, k, rng.randrange(len(_WORDINGS))), f"start {s}, 1-{m}, stop {k}"


def parse_answer(answer: str) -> tuple[int, int, int]:
    """`"start 12, 1-8, stop 6"` -> (12, 8, 6)."""
    m = _ANSWER.fullmatch(answer.strip())
    if not m:
        raise ValueError(f"not a draws answer ('start S, 1-TOP, stop K'): {answer!r}")
    return int(m[1]), int(m[2]), int(m[3])


class Deck:
    """One episode's draws: uniform on 1..top from its own generator, except that the `MOST_DRAWS`-th
    draw is uniform on stop..top (so every episode ends within the task's calls). `told`: each draw also
    says whether it stops the episode (`"7 stop"`, `"3 more"`), so the model reads the rule's verdict
    instead of comparing numbers itself (chat_draws_told)."""

    def __init__(self, top: int, stop: int, seed: int, told: bool = False) -> None:
        self.top, self.stop, self.rng, self.drawn, self.told = top, stop, random.Random(seed), 0, told

    def draw(self, arguments: str = "") -> str:
        self.drawn += 1
        low = self.stop if self.drawn >= MOST_DRAWS else 1
        n = self.rng.randint(low, self.top)
        return f"{n} {'stop' if n >= self.stop else 'more'}" if self.told else str(n)


def episode(seed: int, prompt: str) -> dict[str, Callable[[str], str]]:
    """`Task.episode` of chat_draws: the toolbox of one completion, `{"draw": ...}` with its own deck."""
    _, top, stop = parse_prompt(prompt)
    return {"draw": Deck(top, stop, seed).draw}


def episode_told(seed: int, prompt: str) -> dict[str, Callable[[str], str]]:
    """`Task.episode` of chat_draws_told: as `episode`, each draw saying whether it stops."""
    _, top, stop = parse_prompt(prompt)
    return {"draw": Deck(top, stop, seed, told=True).draw}


def draws_reward(completion: str, answer: str) -> float:
    """1.0 for a completion that stops at the right draw and gives start + the draws (see the module's
    docstring), else 0.0."""
    start, _, stop = parse_answer(answer)
    draws = [int(d) for d in _DRAW.findall(completion)]
    if not draws or draws[-1] < stop or any(d >= stop for d in draws[:-1]):
        return 0.0
    return final_number_reward(completion.rpartition(OUTPUT_END)[2], str(start + sum(draws)))


def demonstrate_draws(
    prompt: str, answer: str, rng: random.Random, told: bool = False
) -> list[tuple[str, bool]]:
    """`Task.demonstrate`: a right answer against a deck drawn from `rng` (`told`: chat_draws_told's),
    split into the model's text (trained) and the tool's output (not trained), as a rollout would give it."""
    start, top, stop = parse_answer(answer)
    if parse_prompt(prompt) != (start, top, stop):
        raise ValueError(f"answer {answer!r} does not belong to prompt {prompt!r}")
    deck = Deck(top, stop, rng.getrandbits(63), told)
    parts: list[tuple[str, bool]] = []
    total, lead = start, ""
    while True:
        out = deck.draw()
        n = int(out.split()[0])
        parts += [(lead + CALL, True), (OUTPUT_START + out + OUTPUT_END, False)]
        lead = f" {total} + {n} = {total + n}."
        total += n
        if n >= stop:
            break
        lead += " "
    parts.append((lead + f" The total is {total}.", True))
    return parts


def demonstrate_draws_told(prompt: str, answer: str, rng: random.Random) -> list[tuple[str, bool]]:
    """`Task.demonstrate` of chat_draws_told."""
    return demonstrate_draws(prompt, answer, rng, told=True)

"""Worked solutions for the chat sum tasks (`chat_problems`: chat_addlist, chat_addlist_work, chat_basket),
the targets of a supervised warm start (`otbrl.app.sft`).

Each solution takes one of three styles, drawn per example, so that a model warm-started on them samples
answers of different lengths for the same problem (the within-group variation OTB is for) and RL can
learn which style pays (with two terms, steps and whole are the same text: two lengths, not three):

    steps   one addition per line of working: "3 + 8 = 11. 11 + 5 = 16. The total is 16."
    whole   all terms in one line:            "3 + 8 + 5 = 16. The total is 16."
    brief   the total alone:                  "The total is 16."

Pure functions of the prompt, its answer and a random generator; the terms are the prompt's integers in
the order it poses them, and a prompt whose integers do not add up to its answer is refused (not a sum).
"""

from __future__ import annotations

import random
import re

STYLES = ("steps", "whole", "brief")
WEIGHTS = (0.5, 0.25, 0.25)  # steps, whole, brief


def sum_terms(prompt: str, answer: str) -> list[int]:
    """The terms of a sum problem: every integer of `prompt`, in order; they must add up to `answer`."""
    terms = [int(t) for t in re.findall(r"\d+", prompt)]
    if len(terms) < 2 or sum(terms) != int(answer):
        raise ValueError(f"not a sum problem: the integers {terms} of {prompt!r} do not add up to {answer}")
    return terms


def worked(terms: list[int], style: str) -> str:
    """One worked solution of sum(terms) in `style` (see the module's docstring)."""
    total = sum(terms)
    end = f"The total is {total}."
    if style == "brief":
        return end
    if style == "whole":
        return f"{' + '.join(map(str, terms))} = {total}. {end}"
    if style == "steps":
        lines, running = [], terms[0]
        for t in terms[1:]:
            lines.append(f"{running} + {t} = {running + t}.")
            running += t
        return " ".join([*lines, end])
    raise ValueError(f"style: one of {STYLES}, got {style!r}")


def worked_solution(prompt: str, answer: str, rng: random.Random) -> str:
    """A worked solution of a sum problem, its style drawn with `WEIGHTS`."""
    return worked(sum_terms(prompt, answer), rng.choices(STYLES, WEIGHTS)[0])


def demonstrate_sum(prompt: str, answer: str, rng: random.Random) -> list[tuple[str, bool]]:
    """`Task.demonstrate` for the chat sum tasks: one worked solution, all of it the model's own text."""
    return [(worked_solution(prompt, answer, rng), True)]

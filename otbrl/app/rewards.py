"""Reward functions for datasets with an answer column, in TRL's calling convention
`f(prompts=..., completions=..., answer=..., **kwargs) -> list[float]`.

exact: the stripped completion equals the answer. numeric: the last number in the completion equals the
answer's number (relative tolerance 1e-6). math: math-verify's symbolic comparison (`pip install
math-verify`), for LaTeX or free-text math answers.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*)?\.?\d+(?:[eE][-+]?\d+)?")


def last_number(text: str) -> float | None:
    """The last number written in `text` (thousands separators allowed), or None."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def exact(completions: list[str], answer: list[str], **_: Any) -> list[float]:
    return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answer, strict=True)]


def numeric(completions: list[str], answer: list[str], **_: Any) -> list[float]:
    out = []
    for c, a in zip(completions, answer, strict=True):
        got, want = last_number(c), last_number(str(a))
        out.append(float(got is not None and want is not None and math.isclose(got, want, rel_tol=1e-6)))
    return out


def math_answer(completions: list[str], answer: list[str], **_: Any) -> list[float]:
    try:
        from math_verify import parse, verify
    except ImportError as err:
        raise ImportError("the 'math' reward needs math-verify: pip install 'otbrl[math]'") from err
    return [float(verify(parse(str(a)), parse(c))) for c, a in zip(completions, answer, strict=True)]


REWARDS: dict[str, Callable[..., list[float]]] = {"exact": exact, "numeric": numeric, "math": math_answer}


def get_reward(name: str) -> Callable[..., list[float]]:
    if name not in REWARDS:
        raise ValueError(f"reward: unknown reward {name!r}; known: {', '.join(sorted(REWARDS))}, task")
    fn = REWARDS[name]

    def reward(prompts: list[str], completions: list[str], answer: list[str], **kwargs: Any) -> list[float]:
        return fn(completions, answer)

    reward.__name__ = f"{name}_reward"
    return reward

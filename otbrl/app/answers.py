"""Reward functions for datasets with an answer column, in TRL's calling convention
`f(prompts=..., completions=..., answer=..., **kwargs) -> list[float]`. Completions may be plain text or
chat messages (TRL's conversational format: a list of {"role", "content"} dicts); the text of the last
assistant message is scored.

exact: the stripped completion equals the answer. numeric: the number in the completion's last
\\boxed{...} (else its last number) equals the answer's number (relative tolerance 1e-6). math:
math-verify's symbolic comparison (`pip install math-verify`), for LaTeX or free-text math answers.
Answers written as a worked solution ending in `#### 72` (GSM8K) are compared by what follows `####`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*)?\.?\d+(?:[eE][-+]?\d+)?")


def completion_text(completion: Any) -> str:
    """The text of a completion: a string, one message dict, or a list of messages (the last assistant
    message's content; TRL's conversational completions)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return str(completion.get("content") or "")
    if isinstance(completion, list | tuple):
        said = [m for m in completion if isinstance(m, dict) and m.get("role", "assistant") == "assistant"]
        return str(said[-1].get("content") or "") if said else ""
    return str(completion)


def final_answer(answer: Any) -> str:
    """The reference answer: what follows the last `####` in a worked solution (GSM8K), else all of it."""
    text = str(answer)
    return text.rpartition("####")[2].strip() if "####" in text else text.strip()


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (or \\fbox{...}) in `text`, braces balanced, or None."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def last_number(text: str) -> float | None:
    """The last number written in `text` (thousands separators allowed), or None."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def answer_number(text: str) -> float | None:
    """The number a completion answers with: inside its last \\boxed{} if any, else its last number."""
    boxed = last_boxed(text)
    return last_number(boxed if boxed is not None else text)


def exact(completions: list[str], answer: list[str], **_: Any) -> list[float]:
    return [float(c.strip() == final_answer(a)) for c, a in zip(completions, answer, strict=True)]


def numeric(completions: list[str], answer: list[str], **_: Any) -> list[float]:
    out = []
    for c, a in zip(completions, answer, strict=True):
        got, want = answer_number(c), last_number(final_answer(a))
        out.append(float(got is not None and want is not None and math.isclose(got, want, rel_tol=1e-6)))
    return out


def math_answer(completions: list[str], answer: list[str], **_: Any) -> list[float]:
    try:  # the optional 'math' extra, needed by this reward alone
        from math_verify import parse, verify
    except ImportError as err:
        raise ImportError("the 'math' reward needs math-verify: pip install 'otbrl[math]'") from err
    return [float(verify(parse(final_answer(a)), parse(c))) for c, a in zip(completions, answer, strict=True)]


REWARDS: dict[str, Callable[..., list[float]]] = {"exact": exact, "numeric": numeric, "math": math_answer}


def get_reward(name: str) -> Callable[..., list[float]]:
    if name not in REWARDS:
        raise ValueError(f"reward: unknown reward {name!r}; known: {', '.join(sorted(REWARDS))}, task")
    fn = REWARDS[name]

    def reward(prompts: list, completions: list, answer: list[str], **kwargs: Any) -> list[float]:
        return fn([completion_text(c) for c in completions], answer)

    reward.__name__ = f"{name}_reward"
    return reward

"""Held-out prompts that no training run can draw, by construction: a prompt's side of the split is a
fixed function of its text (a keyed hash), so training and evaluation never share a prompt, whatever the
seeds, sizes or machines. Pure Python.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Literal

Split = Literal["train", "heldout"]
SPLITS: tuple[str, ...] = ("train", "heldout")


def held_out(prompt: str, fraction: float, salt: str = "otbrl") -> bool:
    """True when `prompt` belongs to the held-out side of a split that keeps `fraction` of all prompts.

    The side is blake2b(salt, prompt) read as a number in [0, 1): stable across Python versions and
    processes (unlike `hash`), and independent of any random generator."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"fraction: must lie in (0, 1), got {fraction!r}")
    digest = hashlib.blake2b(prompt.encode(), digest_size=8, key=salt.encode()[:64]).digest()
    return int.from_bytes(digest, "big") / 2.0**64 < fraction


def draw(
    make: Callable[[], tuple[str, str]],
    split: Split,
    fraction: float,
    salt: str = "otbrl",
    tries: int = 10_000,
    key: Callable[[str], str] | None = None,
) -> tuple[str, str]:
    """One (prompt, answer) from `make` that lies on `split`'s side: rejection sampling, so the draw keeps
    `make`'s distribution restricted to that side. `key(prompt)` names the problem a prompt poses when
    several wordings pose the same one (all of them then fall on one side); by default the prompt itself."""
    if split not in SPLITS:
        raise ValueError(f"split: must be one of {SPLITS}, got {split!r}")
    want = split == "heldout"
    for _ in range(tries):
        prompt, answer = make()
        if held_out(key(prompt) if key else prompt, fraction, salt) == want:
            return prompt, answer
    raise RuntimeError(f"split: no {split} prompt in {tries} draws (is the prompt space tiny?)")

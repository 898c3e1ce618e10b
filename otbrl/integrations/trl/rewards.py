"""Reward functions under guard: a user's reward function that fails costs a sample, not the run, and
its failures are counted."""

from __future__ import annotations

import functools
import math
from typing import Any


class GuardedReward:
    """A reward function whose failures cost one sample, not the run: an exception or a NaN/inf value
    gives that sample reward 0 and is counted (`failures`). None passes through (TRL: not applicable)."""

    def __init__(self, fn: Any) -> None:
        functools.update_wrapper(self, fn)
        self.fn, self.failures = fn, 0

    def _value(self, v: Any) -> float | None:
        if v is None:
            return None
        try:
            v = float(v)
        except (TypeError, ValueError):
            v = math.nan
        if math.isfinite(v):
            return v
        self.failures += 1
        return 0.0

    def __call__(self, prompts: list, completions: list, **kwargs: Any) -> list[float | None]:
        try:
            values = list(self.fn(prompts=prompts, completions=completions, **kwargs))
            if len(values) != len(prompts):
                raise ValueError(f"reward function returned {len(values)} values for {len(prompts)} samples")
        except Exception:  # noqa: BLE001  -- find the failing samples one by one
            values = [self._one(i, prompts, completions, kwargs) for i in range(len(prompts))]
        return [self._value(v) for v in values]

    def _one(self, i: int, prompts: list, completions: list, kwargs: dict) -> Any:
        n = len(prompts)
        single = {k: (v[i : i + 1] if isinstance(v, list) and len(v) == n else v) for k, v in kwargs.items()}
        try:
            return list(self.fn(prompts=prompts[i : i + 1], completions=completions[i : i + 1], **single))[0]
        except Exception:  # noqa: BLE001
            return math.nan

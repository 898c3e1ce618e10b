"""Reward functions under guard: a sample whose reward fails costs that sample, not the run, but failures are
loud. A failed sample is left unscored (None), never given a made-up reward. The first failure of each
function is logged with its exception and the sample; a function that cannot take TRL's keyword arguments,
that fails on every sample of a batch, or on more than a set fraction of all samples stops the run with
`RewardFailure`."""

from __future__ import annotations

import functools
import inspect
import logging
import math
from typing import Any

logger = logging.getLogger("otbrl.rewards")


class RewardFailure(RuntimeError):
    """A reward function failed too often to go on training: the message has its exception text."""


class _Failed:
    """A sample whose reward could not be computed, and why."""

    def __init__(self, why: str) -> None:
        self.why = why


def _short(value: Any, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class GuardedReward:
    """A reward function whose failures cost one sample each: an exception or a NaN/inf value leaves that
    sample unscored (None, which TRL reads as NaN) and is counted (`failures`, over `scored` samples); the
    positions of the latest call's failures are in `last_failed`, so that OTBGRPOTrainer can take such a
    row out of its group (a reward of 0 would be trained on and pull its peers' baseline toward 0). None
    from the function passes through (TRL: not applicable). A batch that fails is retried one sample at a
    time (each sample at most once) to find the failing samples.

    The run stops (`RewardFailure`) when the function's signature cannot take the keyword arguments it
    is called with, when every sample of a batch fails, or when failures exceed `max_failure_fraction` of
    the samples scored so far. Wrapping a GuardedReward again without options returns it unchanged.
    """

    def __new__(cls, fn: Any, **options: Any) -> GuardedReward:
        if isinstance(fn, GuardedReward) and not options:
            return fn  # OTBGRPOTrainer wraps every function: keep the caller's settings and counts
        return super().__new__(cls)

    def __init__(self, fn: Any, *, max_failure_fraction: float = 0.5) -> None:
        if fn is self:  # returned as is by __new__
            return
        if not 0 < max_failure_fraction <= 1:
            raise ValueError(f"max_failure_fraction: must be in (0, 1], got {max_failure_fraction!r}")
        functools.update_wrapper(self, fn)
        self.fn, self.max_failure_fraction = fn, max_failure_fraction
        self.failures, self.scored, self.calls = 0, 0, 0
        self.last_failed: list[int] = []  # positions that failed in the latest call
        self.first_failure: str | None = None
        self.name = getattr(fn, "__name__", type(fn).__name__)
        try:
            self._signature: inspect.Signature | None = inspect.signature(fn)
        except (TypeError, ValueError):
            self._signature = None

    def _check_call(self, prompts: list, completions: list, kwargs: dict) -> None:
        """A signature that cannot take these keywords fails on every sample: stop now, say why."""
        if self._signature is None:
            return
        try:
            self._signature.bind(prompts=prompts, completions=completions, **kwargs)
        except TypeError as err:
            raise RewardFailure(
                f"reward function {self.name}{self._signature} cannot take the keyword arguments it is "
                f"called with (prompts, completions, {', '.join(sorted(kwargs))}): {err}. "
                "Give it a **kwargs parameter"
            ) from None

    def _call(self, prompts: list, completions: list, kwargs: dict) -> list:
        self.calls += 1
        values = list(self.fn(prompts=prompts, completions=completions, **kwargs))
        if len(values) != len(prompts):
            raise ValueError(f"reward function returned {len(values)} values for {len(prompts)} samples")
        return values

    def __call__(self, prompts: list, completions: list, **kwargs: Any) -> list[float | None]:
        self._check_call(prompts, completions, kwargs)
        try:
            values = self._call(prompts, completions, kwargs)
        except Exception:  # noqa: BLE001  -- find the failing samples, each retried once
            values = [self._one(i, prompts, completions, kwargs) for i in range(len(prompts))]
        out, failed = [], []
        for i, v in enumerate(values):
            value = self._value(v)
            if isinstance(value, _Failed):
                failed.append((i, value.why))
                value = None
            out.append(value)
        self.last_failed = [i for i, _ in failed]
        self._account(failed, prompts, completions)
        return out

    def _one(self, i: int, prompts: list, completions: list, kwargs: dict) -> Any:
        n = len(prompts)
        single = {k: (v[i : i + 1] if isinstance(v, list) and len(v) == n else v) for k, v in kwargs.items()}
        try:
            return self._call(prompts[i : i + 1], completions[i : i + 1], single)[0]
        except Exception as err:  # noqa: BLE001
            return _Failed(f"{type(err).__name__}: {err}")

    @staticmethod
    def _value(v: Any) -> float | None | _Failed:
        if v is None or isinstance(v, _Failed):
            return v
        try:
            x = float(v)
        except (TypeError, ValueError):
            return _Failed(f"returned {_short(v)}, not a number")
        return x if math.isfinite(x) else _Failed(f"returned {x}")

    def _account(self, failed: list[tuple[int, str]], prompts: list, completions: list) -> None:
        """Count this batch's failures; log the first one; stop the run when the rules say so."""
        n = len(prompts)
        self.failures += len(failed)
        self.scored += n
        if not failed:
            return
        i, why = failed[0]
        sample = f"prompt {_short(prompts[i])}, completion {_short(completions[i])}"
        if self.first_failure is None:
            self.first_failure = f"{why} (sample: {sample})"
            logger.warning(
                "otbrl: reward function %s failed: %s; sample: %s (such samples are left unscored; "
                "later failures are counted in otb/reward_failures)",
                self.name,
                why,
                sample,
            )
        if len(failed) == n:
            raise RewardFailure(
                f"reward function {self.name} failed on every sample of a batch ({n}): {why}; "
                f"sample: {sample}"
            )
        if self.failures > self.max_failure_fraction * self.scored:
            raise RewardFailure(
                f"reward function {self.name} failed on {self.failures} of {self.scored} samples (more than "
                f"max_failure_fraction {self.max_failure_fraction}); first failure: {self.first_failure}"
            )

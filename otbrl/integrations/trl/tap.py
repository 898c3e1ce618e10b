"""log sum pi^2 out of TRL's own old-log-prob pass, so that OTB's energy costs no forward of its own.

TRL 1.16 patches the policy with its fused output head (`trl.trainer.utils.add_fused_lm_head`, outputs
log-probs and entropy) and offers no per-call way to ask that head for more. Its `outputs` argument can
also return `log_sum_sq_probs` (log sum_v pi_v^2 at the sampling temperature, with the family's logit
scale and soft-capping, no gradient), so `LogSumSqTap` gives the model a second fused head that does, and
routes a forward to it only inside `capture()`: every other forward, training's included, runs TRL's
head unchanged. This is the one place otbrl patches a forward.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from trl.trainer.utils import add_fused_lm_head


class LogSumSqTap:
    """Install on the model TRL patched (the base model under PEFT), with TRL's temperature and head
    precision. `with tap.capture() as seen:` appends the (B, L) log sum pi^2 of each fused forward run
    inside the block to `seen`."""

    def __init__(self, model: Any, temperature: float, cast_lm_head_to_fp32: bool) -> None:
        self._trl_forward = model.forward
        add_fused_lm_head(
            model,
            temperature=temperature,
            cast_lm_head_to_fp32=cast_lm_head_to_fp32,
            outputs=("log_probs", "entropy", "log_sum_sq_probs"),
        )
        self._with_sq = model.forward
        self._sink: list[torch.Tensor] | None = None
        # functools.wraps keeps TRL's signature: `generate` validates its keyword arguments against it
        model.forward = functools.wraps(self._trl_forward)(lambda *a, **kw: self._route(*a, **kw))

    def _route(self, *args: Any, **kwargs: Any) -> Any:
        if self._sink is None or not kwargs.get("fused_lm_head"):
            return self._trl_forward(*args, **kwargs)
        out = self._with_sq(*args, **kwargs)
        self._sink.append(out.log_sum_sq_probs)
        return out

    @contextmanager
    def capture(self) -> Iterator[list[torch.Tensor]]:
        """Record log sum pi^2 of the fused forwards inside the block (not nested, not thread-safe)."""
        self._sink = []
        try:
            yield self._sink
        finally:
            self._sink = None

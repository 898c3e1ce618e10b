"""Names shared by the verl plugin's modules: otbrl's estimator names under verl, the trainer mode, the
environment switch, and the context through which the trainer mode hands per-token statistics to the
estimators (verl's compute_advantage passes only rewards, mask, uid and config to estimators it does not
know)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch

# verl estimator name -> (align, leave_one_out) of otbrl's "otb"; "generated" aligns by the k-th policy
# token (multi-turn / TIR).
VERL_ESTIMATORS: dict[str, tuple[str, bool]] = {
    "otbrl_otb": ("position", False),
    "otbrl_otb_loo": ("position", True),
    "otbrl_tir_otb": ("generated", False),
    "otbrl_tir_otb_loo": ("generated", True),
}
TRAINER_MODE = "otbrl_sync"
# Field under which the trainer mode keeps the response-aligned Σπ² (verl's own "sum_pi_squared" field
# in the TransferQueue holds the full-sequence worker output).
STATS_FIELD = "otbrl_sum_pi_squared"
# Opt-in, per process: replace verl's Σπ² (full fp32 copies of the logits) with otbrl's chunked pass.
CHUNKED_ENV = "OTBRL_VERL_CHUNKED_SUM_PI_SQ"

# Per-token statistics for the estimator call in progress, set by the trainer mode; verl's
# compute_advantage passes only rewards, mask, uid and config to estimators it does not know.
_TOKEN_STATS: ContextVar[dict[str, torch.Tensor] | None] = ContextVar("otbrl_verl_token_stats", default=None)


@contextlib.contextmanager
def token_stats(
    old_log_probs: torch.Tensor, sum_pi_squared: torch.Tensor, rollout_is_weights: torch.Tensor | None = None
) -> Iterator[None]:
    """Within the block, otbrl estimators called without these keyword extras read them from here.

    Each tensor is (B, T), padded like the `response_mask` the estimator will receive.
    """
    stats = {"old_log_probs": old_log_probs, "sum_pi_squared": sum_pi_squared}
    if rollout_is_weights is not None:
        stats["rollout_is_weights"] = rollout_is_weights
    token = _TOKEN_STATS.set(stats)
    try:
        yield
    finally:
        _TOKEN_STATS.reset(token)


def current_token_stats() -> dict[str, torch.Tensor] | None:
    """The statistics set by the innermost `token_stats` block, or None outside one."""
    return _TOKEN_STATS.get()

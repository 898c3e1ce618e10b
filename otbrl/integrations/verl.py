"""otbrl's OTB inside verl: advantage estimators under verl's calling convention, and the Σπ² plumbing.

verl imports this module through the `verl.plugins` entry point (or `VERL_USE_EXTERNAL_MODULES`), which
registers the estimators below. verl's default V1 trainer never requests or forwards Σπ², so the
`otbrl_sync` trainer mode (`trainer.v1.trainer_mode=otbrl_sync`) asks the actor for it with the old
log-probs and hands both to the estimator. See docs/verl.md.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from typing import Any

import torch

from otbrl.energy import sum_pi_squared, token_energy_from_logprobs
from otbrl.estimators import compute_advantages

# name -> (align, leave_one_out); "generated" aligns by the k-th policy token (multi-turn / TIR).
ESTIMATORS: dict[str, tuple[str, bool]] = {
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

_OPTIONS = ("leave_one_out", "zero_tail", "eps", "use_is_weights")

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


def otbrl_options(config: Any) -> dict[str, Any]:
    """otbrl's options from verl's algorithm config (`algorithm.otbrl.*`): a DictConfig, a dict, a
    dataclass or None. Unknown keys raise, so a typo does not silently fall back to a default."""
    section = None
    if isinstance(config, Mapping) or hasattr(config, "get"):
        with contextlib.suppress(Exception):  # struct DictConfigs and dataclasses may refuse .get
            section = config.get("otbrl", None)
    if section is None:
        section = getattr(config, "otbrl", None)
    if section is None:
        return {}
    options = dict(section.items())
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise ValueError(f"algorithm.otbrl.{unknown[0]}: unknown option (known: {', '.join(_OPTIONS)})")
    return options


def _rewards_onto_policy_tokens(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Move each reward on a mask == 0 token (a tool token, or one rejection sampling masked) onto the
    last policy token at or before it; verl's estimators drop such rewards. Rewards with no policy
    token before them (rejected rows) are dropped."""
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last_policy = torch.where(mask, positions, -1).cummax(dim=-1).values
    off = torch.where(mask | (last_policy < 0), 0.0, rewards)
    moved = torch.zeros_like(rewards).scatter_add_(-1, last_policy.clamp_min(0), off)
    return torch.where(mask, rewards, 0.0) + moved


def _estimator(align: str, leave_one_out: bool) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """An estimator with verl's calling convention for one (alignment, leave-one-out) choice."""

    def estimate(
        token_level_rewards: torch.Tensor,
        response_mask: torch.Tensor,
        index: Any = None,
        config: Any = None,
        old_log_probs: torch.Tensor | None = None,
        sum_pi_squared: torch.Tensor | None = None,
        rollout_is_weights: torch.Tensor | None = None,
        **_: Any,  # verl passes extras for other estimators (reward_baselines, ...)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """verl estimator: (B, T) token rewards, response mask, uid array -> (advantages, returns)."""
        if index is None:
            raise ValueError("index: otbrl's OTB needs the prompt uid of every row (verl's 'uid')")
        stats = _TOKEN_STATS.get() or {}
        if old_log_probs is None or sum_pi_squared is None:
            old_log_probs, sum_pi_squared = stats.get("old_log_probs"), stats.get("sum_pi_squared")
            rollout_is_weights = stats.get("rollout_is_weights", rollout_is_weights)
        if old_log_probs is None or sum_pi_squared is None:
            raise ValueError(
                "sum_pi_squared: otbrl's OTB needs per-token Σπ² and old log-probs; verl's default trainer "
                f"does not pass them: set trainer.v1.trainer_mode={TRAINER_MODE} (see docs/verl.md)"
            )
        options = otbrl_options(config)
        use_is = options.pop("use_is_weights", True)
        options.setdefault("leave_one_out", leave_one_out)
        mask = response_mask.bool()
        # Padding may hold anything (the stats come padded): read the statistics at policy tokens only.
        energy = token_energy_from_logprobs(
            torch.where(mask, old_log_probs, 0.0), torch.where(mask, sum_pi_squared, 1.0)
        )
        weights = rollout_is_weights if use_is else None
        result = compute_advantages(
            "otb",
            rewards=_rewards_onto_policy_tokens(token_level_rewards.float(), mask),
            mask=mask,
            group_ids=index,
            energy=energy,
            align=align,
            is_weights=None if weights is None else torch.where(mask, weights, 0.0),
            **options,
        )
        dtype = token_level_rewards.dtype
        return result.advantages.to(dtype), result.returns.to(dtype)

    return estimate


def register() -> None:
    """Register otbrl's estimators with verl (idempotent), the trainer mode where verl's V1 trainer is
    importable, and, if OTBRL_VERL_CHUNKED_SUM_PI_SQ=1, otbrl's chunked Σπ² in place of verl's."""
    from verl.trainer.ppo import core_algos

    for name, (align, loo) in ESTIMATORS.items():
        if name not in core_algos.ADV_ESTIMATOR_REGISTRY:
            core_algos.register_adv_est(name)(_estimator(align, loo))
    with contextlib.suppress(ImportError):  # V1 needs TransferQueue; without it only the estimators
        from otbrl.integrations import verl_trainer  # noqa: F401  (registers the trainer mode)
    if os.environ.get(CHUNKED_ENV, "0") == "1":
        use_chunked_sum_pi_squared()


def _chunked_sum_pi_squared(logits: torch.Tensor) -> torch.Tensor:
    # verl calls it with logits already divided by the temperature, hence no temperature here.
    return sum_pi_squared(logits)


def use_chunked_sum_pi_squared() -> None:
    """Compute Σπ² in verl's actor with otbrl's chunked passes: from the logits with float32
    accumulation and one working tile instead of full float32 copies of the (tokens, vocab) logits,
    and, with verl's fused kernels on (where verl refuses), from the hidden states and output head."""
    from verl.utils import torch_functional

    from otbrl.integrations import verl_fused

    torch_functional.calculate_sum_pi_squared_from_logits = _chunked_sum_pi_squared
    verl_fused.install()


register()

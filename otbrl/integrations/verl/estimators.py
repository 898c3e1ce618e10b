"""otbrl's OTB under verl's estimator calling convention: (B, T) token rewards, response mask, uid array
and config in; (advantages, returns) out. Only translation happens here: energy from verl's old
log-probs and Σπ², rewards onto policy tokens and the estimator itself come from otbrl's core."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from otbrl.energy import token_energy_from_logprobs
from otbrl.estimators import ESTIMATORS, compute_advantages, resolve
from otbrl.inputs import rewards_onto_policy_tokens
from otbrl.integrations.verl.common import TRAINER_MODE, VERL_ESTIMATORS, current_token_stats

# otb's options, less the two this adapter sets (align from the estimator's name, is_weights from verl's
# rollout importance weights), plus its own switch use_is_weights. Their rules are otb's (resolve).
_SET_HERE = ("align", "is_weights")
_OPTIONS = (*(name for name in ESTIMATORS["otb"].options if name not in _SET_HERE), "use_is_weights")


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


def estimator_options(name: str, config: Any) -> dict[str, Any]:
    """otb's options for the verl estimator `name` (a key of VERL_ESTIMATORS) under `config`.

    The name decides what it says: the "_loo" names are the leave-one-out form, so
    `algorithm.otbrl.leave_one_out: false` contradicts them and raises (true is allowed, as it agrees).
    The other names are the self-inclusive form by default, and leave_one_out may switch them.
    """
    if name not in VERL_ESTIMATORS:
        raise ValueError(f"name: unknown otbrl estimator {name!r} (known: {', '.join(VERL_ESTIMATORS)})")
    pinned = VERL_ESTIMATORS[name][1]
    options = otbrl_options(config)
    value = options.setdefault("leave_one_out", pinned)
    if not isinstance(value, bool):
        raise ValueError(f"algorithm.otbrl.leave_one_out: expected true or false, got {value!r}")
    if pinned and not value:
        base = name.removesuffix("_loo")
        raise ValueError(
            f"algorithm.otbrl.leave_one_out: false contradicts adv_estimator {name!r}, the leave-one-out "
            f"form; use {base!r} for the self-inclusive one, or drop the option"
        )
    use_is = options.get("use_is_weights", True)
    if not isinstance(use_is, bool):
        raise ValueError(f"algorithm.otbrl.use_is_weights: expected true or false, got {use_is!r}")
    try:  # otb's own rules for the values of its options
        resolve("otb", {k: v for k, v in options.items() if k != "use_is_weights"})
    except ValueError as err:
        raise ValueError(f"algorithm.otbrl.{err}") from None
    return options


def _estimator(name: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The verl estimator `name` (a key of VERL_ESTIMATORS) with verl's calling convention."""
    align = VERL_ESTIMATORS[name][0]

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
        stats = current_token_stats() or {}
        if old_log_probs is None or sum_pi_squared is None:
            old_log_probs, sum_pi_squared = stats.get("old_log_probs"), stats.get("sum_pi_squared")
            rollout_is_weights = stats.get("rollout_is_weights", rollout_is_weights)
        if old_log_probs is None or sum_pi_squared is None:
            raise ValueError(
                "sum_pi_squared: otbrl's OTB needs per-token Σπ² and old log-probs; verl's default trainer "
                f"does not pass them: set trainer.v1.trainer_mode={TRAINER_MODE} (see docs/verl.md)"
            )
        options = estimator_options(name, config)
        use_is = options.pop("use_is_weights", True)
        mask = response_mask.bool()
        # Padding may hold anything (the stats come padded): read the statistics at policy tokens only.
        energy = token_energy_from_logprobs(
            torch.where(mask, old_log_probs, 0.0), torch.where(mask, sum_pi_squared, 1.0)
        )
        weights = rollout_is_weights if use_is else None
        result = compute_advantages(
            "otb",
            rewards=rewards_onto_policy_tokens(token_level_rewards.float(), mask),
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


def register_estimators() -> None:
    """Register otbrl's estimators in verl's registry (idempotent)."""
    from verl.trainer.ppo import core_algos  # verl is heavy: imported when verl loads this plugin

    for name in VERL_ESTIMATORS:
        if name not in core_algos.ADV_ESTIMATOR_REGISTRY:
            core_algos.register_adv_est(name)(_estimator(name))

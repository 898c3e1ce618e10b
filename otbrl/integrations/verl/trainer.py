"""The `otbrl_sync` trainer mode: verl's synchronous V1 trainer plus the Σπ² plumbing otbrl's OTB needs.

verl's V1 trainer neither asks the actor for Σπ² nor forwards it to the estimator. This mode sets the
actor's `calculate_sum_pi_squared` flag for the old-log-prob pass only, keeps the response-aligned
result in the TransferQueue, and exposes it (with old log-probs and rollout IS weights) to the estimator
through `otbrl.integrations.verl.token_stats`. Imported by `otbrl.integrations.verl` when verl's V1
trainer (which needs TransferQueue) is importable.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import transfer_queue as tq
from omegaconf import OmegaConf
from tensordict import TensorDict
from verl.protocol import DataProto
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.workers.utils.padding import response_from_nested

from otbrl.integrations.verl.common import (
    CHUNKED_ENV,
    STATS_FIELD,
    TRAINER_MODE,
    VERL_ESTIMATORS,
    token_stats,
)


def chunked_in_workers(config: Any) -> bool:
    """Whether verl's workers get CHUNKED_ENV=1: from ray_kwargs.ray_init.runtime_env.env_vars, or from
    this process's environment, which Ray workers started on this node inherit."""
    env = OmegaConf.select(config, "ray_kwargs.ray_init.runtime_env.env_vars", default=None) or {}
    return str(env.get(CHUNKED_ENV, os.environ.get(CHUNKED_ENV, "0"))) == "1"


def check_config(config: Any) -> bool:
    """True when the configured estimator is one of otbrl's (so Σπ² must flow); raises ValueError for
    settings under which the actor cannot produce Σπ²."""
    if config.algorithm.adv_estimator not in VERL_ESTIMATORS:
        return False
    if config.actor_rollout_ref.model.get("use_fused_kernels", False) and not chunked_in_workers(config):
        raise ValueError(
            "actor_rollout_ref.model.use_fused_kernels: verl's fused kernels never form the logits and its "
            f"FSDP engine refuses Σπ² with them; set {CHUNKED_ENV}=1 for the workers (otbrl then computes "
            "it from the hidden states) or turn fused kernels off"
        )
    correction = config.algorithm.get("rollout_correction", None)
    if correction is not None and correction.get("bypass_mode", False):
        raise ValueError(
            "algorithm.rollout_correction.bypass_mode: bypass mode reuses the rollout engine's "
            "log-probs and skips the actor pass that computes Σπ²; otbrl's OTB needs that pass"
        )
    return True


def response_sum_pi_squared(worker_output: TensorDict) -> TensorDict:
    """The actor's Σπ² (nested, one value per prompt + response position, shifted like log-probs) ->
    `{STATS_FIELD: nested (B, response_len)}`, aligned with the response tokens as old_log_probs is."""
    stats = response_from_nested(worker_output["sum_pi_squared"], worker_output["response_mask"])
    return TensorDict({STATS_FIELD: stats}, batch_size=worker_output.batch_size)


def advantage_token_stats(data: DataProto, rollout_correction: Any = None) -> dict[str, torch.Tensor]:
    """Padded (B, T) old_log_probs, sum_pi_squared and, where rollout correction is on, rollout IS
    weights, from a batch holding response_mask, old_log_probs, STATS_FIELD (and rollout_log_probs).

    The IS weights are recomputed with verl's own function on the same inputs as the trainer's call,
    which keeps them to itself."""
    stats = {"old_log_probs": data.batch["old_log_probs"], "sum_pi_squared": data.batch[STATS_FIELD]}
    if rollout_correction is not None and "rollout_log_probs" in data.batch.keys():
        corrected, _ = compute_rollout_correction_and_add_to_batch(data, rollout_correction)
        if "rollout_is_weights" in corrected.batch.keys():
            stats["rollout_is_weights"] = corrected.batch["rollout_is_weights"]
    return stats


@register_trainer(TRAINER_MODE)
class OTBPPOTrainerSync(PPOTrainerSync):
    """verl's synchronous trainer; with an otbrl estimator it also computes and forwards Σπ²."""

    # verl's base trainer branches on the mode's name ("sync" or an async mode): behave as "sync",
    # whose settings (trainer.v1.sync.*) this mode shares.
    @property
    def trainer_mode(self) -> str:
        return "sync"

    @trainer_mode.setter
    def trainer_mode(self, _value: str) -> None:
        pass

    def __init__(self, config: Any) -> None:
        self._otbrl_stats = check_config(config)
        super().__init__(config)

    def _compute_old_log_prob(self, batch: Any, metrics: dict) -> Any:
        if not self._otbrl_stats:
            return super()._compute_old_log_prob(batch, metrics)
        request = batch
        request.extra_info["calculate_sum_pi_squared"] = True
        try:
            batch = super()._compute_old_log_prob(request, metrics)
        finally:  # only this pass needs Σπ²: the reference and update passes must not pay for it
            request.extra_info.pop("calculate_sum_pi_squared", None)
        fields = ["sum_pi_squared", "response_mask"]
        output = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
        return tq.kv_batch_put(
            keys=batch.keys, partition_id=batch.partition_id, fields=response_sum_pi_squared(output)
        )

    def _compute_advantage(self, batch: Any, metrics: dict) -> Any:
        if not self._otbrl_stats:
            return super()._compute_advantage(batch, metrics)
        correction = self.config.algorithm.get("rollout_correction", None)
        fields = ["response_mask", "old_log_probs", STATS_FIELD]
        if correction is not None:  # the trainer's own fetch asks for it whether it exists or not
            fields.append("rollout_log_probs")
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
        # Same keys in the same order as the trainer's own fetch, so rows and padding line up.
        with token_stats(**advantage_token_stats(DataProto(batch=data.to_padded_tensor()), correction)):
            return super()._compute_advantage(batch, metrics)

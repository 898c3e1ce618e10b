"""The `otbrl_sync` trainer mode's two steps with verl's real V1 trainer code and a real TransferQueue on a
local Ray instance. Only the GPU actor is a stand-in: it writes per-token outputs to the queue the way
verl's worker does (one value per prompt + response position, Σπ² only when asked for)."""

from __future__ import annotations

import numpy as np
import pytest
import ray
import torch
import transfer_queue as tq
from omegaconf import OmegaConf
from tensordict import TensorDict
from tensordict.tensorclass import NonTensorStack
from verl.trainer.ppo import core_algos

from otbrl.integrations.verl.trainer import OTBPPOTrainerSync
from tests.integrations.verl.batches import verl_batch


@pytest.fixture(scope="module")
def queue():
    # Logical CPUs: TransferQueue places its controller and one storage unit on one CPU each.
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
    yield tq
    tq.close()
    ray.shutdown()


def nested(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


class StandInActor:
    """verl's actor worker group as the trainer sees it: reads the request's flags, writes outputs."""

    def __init__(self, full_log_probs: list[torch.Tensor], full_sum_pi_sq: list[torch.Tensor]):
        self.full_log_probs, self.full_sum_pi_sq, self.flags = full_log_probs, full_sum_pi_sq, []

    def compute_log_prob(self, meta):
        flags = dict(meta.extra_info)
        self.flags.append(flags)
        out = {"log_probs": nested(self.full_log_probs), "entropy": nested(self.full_log_probs)}
        if flags.get("calculate_sum_pi_squared", False):
            out["sum_pi_squared"] = nested(self.full_sum_pi_sq)
        fields = TensorDict(out, batch_size=len(meta.keys))
        return tq.kv_batch_put(keys=meta.keys, partition_id=meta.partition_id, fields=fields)


def trainer_for(estimator: str, actor: StandInActor) -> OTBPPOTrainerSync:
    config = OmegaConf.create(
        {
            "algorithm": {
                "adv_estimator": estimator,
                "use_kl_in_reward": False,
                "gamma": 1.0,
                "lam": 1.0,
                "norm_adv_by_std_in_grpo": True,
                "rollout_correction": None,
            },
            "actor_rollout_ref": {
                "model": {"use_fused_kernels": False},
                "rollout": {"n": 4, "temperature": 1.0, "calculate_log_probs": False},
                "actor": {"loss_agg_mode": "token-mean", "loss_scale_factor": None},
            },
        }
    )
    # verl's __init__ builds Ray worker groups and a replay buffer; these two steps need only these.
    trainer = object.__new__(OTBPPOTrainerSync)
    trainer.config, trainer.actor_rollout_wg = config, actor
    trainer._otbrl_stats = estimator in ("otbrl_otb", "otbrl_tir_otb")
    return trainer


@pytest.mark.parametrize("name", ["otbrl_otb", "otbrl_tir_otb"])
def test_trainer_mode_requests_and_forwards_sum_pi_squared(queue, name):
    tir = name == "otbrl_tir_otb"
    batch = verl_batch(7, [4, 2, 3], 9, tool_tokens=tir)
    mask = batch["response_mask"]
    rows, width = mask.shape
    # verl keeps responses unpadded: each row's response ends at its last token (policy or tool).
    lengths = [int(torch.nonzero(m).max()) + 1 for m in mask]
    prompts = [3 + i % 4 for i in range(rows)]
    gen = torch.Generator().manual_seed(0)

    def full(values: torch.Tensor) -> list[torch.Tensor]:  # response values -> prompt + response layout
        out = []
        for i in range(rows):
            row = torch.rand(prompts[i] + lengths[i], generator=gen) - 5  # junk where unused
            row[prompts[i] - 1 : prompts[i] - 1 + lengths[i]] = values[i, : lengths[i]]
            out.append(row)
        return out

    actor = StandInActor(full(batch["old_log_probs"]), full(batch["sum_pi_squared"]))
    keys = [f"{uid}_0_{i}" for i, uid in enumerate(batch["index"])]
    fields = {
        "response_mask": nested([mask[i, : lengths[i]] for i in range(rows)]),
        "rm_scores": nested([batch["token_level_rewards"][i, : lengths[i]] for i in range(rows)]),
        "uid": NonTensorStack(*batch["index"].tolist()),
    }
    meta = tq.kv_batch_put(keys=keys, partition_id=name, fields=TensorDict(fields, batch_size=rows))
    trainer = trainer_for(name, actor)

    meta = trainer._compute_old_log_prob(meta, metrics={})
    assert actor.flags[-1]["calculate_sum_pi_squared"] is True
    meta = trainer._compute_advantage(meta, metrics={})
    got = tq.kv_batch_get(keys=keys, partition_id=name, select_fields=["advantages"])["advantages"]
    got = got.to_padded_tensor(0.0)

    del batch["rollout_is_weights"]
    verl_name = "tir_optimal_token_baseline" if tir else "optimal_token_baseline"
    expected, _ = core_algos.get_adv_estimator_fn(verl_name)(**batch, rollout_is_weights=None)
    torch.testing.assert_close(got, (expected * mask)[:, : got.shape[1]], rtol=1e-5, atol=1e-5)
    assert got.abs().max() > 0.05


def test_other_estimators_do_not_request_sum_pi_squared(queue):
    batch = verl_batch(1, [2, 2], 5, tool_tokens=False)
    mask = batch["response_mask"]
    lengths = [int(m.sum()) for m in mask]
    full = [torch.zeros(2 + n) for n in lengths]
    actor = StandInActor(full, full)
    keys = [f"{uid}_0_{i}" for i, uid in enumerate(batch["index"])]
    fields = TensorDict(
        {"response_mask": nested([m[:n] for m, n in zip(mask, lengths, strict=True)])}, batch_size=4
    )
    meta = tq.kv_batch_put(keys=keys, partition_id="grpo", fields=fields)
    trainer_for("grpo", actor)._compute_old_log_prob(meta, metrics={})
    assert "calculate_sum_pi_squared" not in actor.flags[-1]
    stored = tq.kv_batch_get(
        keys=keys, partition_id="grpo", select_fields=["old_log_probs", "otbrl_sum_pi_squared"]
    )
    assert "old_log_probs" in stored.keys() and "otbrl_sum_pi_squared" not in stored.keys()
    assert np.isfinite(stored["old_log_probs"].to_padded_tensor(0.0).numpy()).all()

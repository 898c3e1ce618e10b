"""The Σπ² plumbing at unit level with verl's own data structures and functions: the actor's output is
aligned to response tokens, verl's `compute_advantage` hands the statistics to otbrl's estimator, rollout
IS weights come along, the trainer mode is registered and refuses settings that cannot produce Σπ²."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from tensordict import TensorDict
from verl.protocol import DataProto
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.ray_trainer import compute_advantage
from verl.trainer.ppo.v1 import PPOTrainerSync, get_trainer_cls
from verl.utils import torch_functional as verl_F
from verl.workers.engine.fsdp import transformer_impl

import otbrl
import otbrl.integrations.verl as plugin
from otbrl.integrations.verl.common import current_token_stats
from otbrl.integrations.verl.trainer import (
    OTBPPOTrainerSync,
    advantage_token_stats,
    check_config,
    response_sum_pi_squared,
)
from tests.integrations.verl.batches import verl_batch


def as_dataproto(batch: dict, stats_field: str) -> DataProto:
    tensors = {
        "token_level_rewards": batch["token_level_rewards"],
        "response_mask": batch["response_mask"],
        "old_log_probs": batch["old_log_probs"],
        stats_field: batch["sum_pi_squared"],
    }
    return DataProto.from_single_dict({**tensors, "uid": batch["index"]})


@pytest.mark.parametrize("name", ["otbrl_otb", "otbrl_tir_otb"])
def test_compute_advantage_hands_sum_pi_squared_to_otbrl(name):
    batch = verl_batch(3, [4, 3, 2], 11, tool_tokens=name == "otbrl_tir_otb")
    algo = OmegaConf.create({"adv_estimator": name})
    verl_name = {"otbrl_otb": "optimal_token_baseline", "otbrl_tir_otb": "tir_optimal_token_baseline"}[name]
    # verl's own OTB reads Σπ² from data.batch["sum_pi_squared"] in compute_advantage.
    expected = compute_advantage(as_dataproto(batch, "sum_pi_squared"), verl_name, config=algo)
    # For any other estimator name compute_advantage passes no statistics: otbrl's fails loudly...
    data = as_dataproto(batch, plugin.STATS_FIELD)
    with pytest.raises(ValueError, match="sum_pi_squared"):
        compute_advantage(data, name, config=algo)
    # ...and inside the trainer mode's context it receives them.
    with plugin.token_stats(**advantage_token_stats(data)):
        got = compute_advantage(data, name, config=algo)
    keep = batch["response_mask"].bool()
    torch.testing.assert_close(
        got.batch["advantages"], expected.batch["advantages"] * keep, rtol=1e-5, atol=1e-5
    )
    assert got.batch["advantages"].abs().max() > 0.05
    assert current_token_stats() is None  # nothing leaks into later calls


def test_rollout_is_weights_are_verls_truncated_ratios():
    batch = verl_batch(0, [3, 3], 7, tool_tokens=False)
    data = as_dataproto(batch, plugin.STATS_FIELD)
    gen = torch.Generator().manual_seed(5)
    rollout = batch["old_log_probs"] + torch.randn(batch["old_log_probs"].shape, generator=gen)
    data.batch["rollout_log_probs"] = rollout
    assert "rollout_is_weights" not in advantage_token_stats(data)
    correction = OmegaConf.create({"rollout_is": "token", "rollout_is_threshold": 2.0})
    stats = advantage_token_stats(data, correction)
    keep = batch["response_mask"].bool()
    expected = (batch["old_log_probs"] - rollout).exp().clamp(max=2.0)
    torch.testing.assert_close(stats["rollout_is_weights"][keep], expected[keep])
    torch.testing.assert_close(stats["sum_pi_squared"], batch["sum_pi_squared"])
    assert torch.equal(data.batch["response_mask"], batch["response_mask"])  # the caller's batch untouched


def test_actor_output_is_aligned_to_response_tokens():
    # The actor returns one value per prompt + response position, shifted by one like log-probs (the
    # prediction of token k sits at position k - 1). Value = position makes the alignment visible.
    prompts, responses = [3, 5, 2], [4, 1, 6]
    full = [torch.arange(p + r, dtype=torch.float32) for p, r in zip(prompts, responses, strict=True)]
    output = TensorDict(
        {
            "sum_pi_squared": torch.nested.as_nested_tensor(full, layout=torch.jagged),
            "response_mask": torch.nested.as_nested_tensor(
                [torch.ones(r) for r in responses], layout=torch.jagged
            ),
        },
        batch_size=[3],
    )
    stats = response_sum_pi_squared(output)[plugin.STATS_FIELD]
    for row, (p, r) in zip(stats.unbind(), zip(prompts, responses, strict=True), strict=True):
        torch.testing.assert_close(row, torch.arange(p - 1, p + r - 1, dtype=torch.float32))


def config(estimator: str, **overrides) -> OmegaConf:
    base = {
        "algorithm": {"adv_estimator": estimator, "rollout_correction": {"bypass_mode": False}},
        "actor_rollout_ref": {"model": {"use_fused_kernels": False}},
    }
    return OmegaConf.merge(OmegaConf.create(base), OmegaConf.create(overrides))


def test_check_config(monkeypatch):
    monkeypatch.delenv(plugin.CHUNKED_ENV, raising=False)
    assert check_config(config("otbrl_otb")) is True
    assert check_config(config("grpo")) is False
    fused = {"actor_rollout_ref": {"model": {"use_fused_kernels": True}}}
    with pytest.raises(ValueError, match="use_fused_kernels"):
        check_config(config("otbrl_tir_otb", **fused))
    assert check_config(config("grpo", **fused)) is False  # other estimators keep verl's behaviour
    # With otbrl's chunked Σπ² in the workers, fused kernels are fine (otbrl.integrations.verl.fused).
    workers = {"ray_kwargs": {"ray_init": {"runtime_env": {"env_vars": {plugin.CHUNKED_ENV: "1"}}}}}
    assert check_config(config("otbrl_tir_otb", **fused, **workers)) is True
    with pytest.raises(ValueError, match="bypass_mode"):
        check_config(config("otbrl_otb_loo", algorithm={"rollout_correction": {"bypass_mode": True}}))


def test_trainer_mode_is_registered_and_behaves_as_sync():
    cls = get_trainer_cls(plugin.TRAINER_MODE)
    assert cls is OTBPPOTrainerSync and issubclass(cls, PPOTrainerSync)
    trainer = object.__new__(cls)
    trainer.trainer_mode = plugin.TRAINER_MODE  # what verl's __init__ assigns from the config
    assert trainer.trainer_mode == "sync"


def test_chunked_sum_pi_squared_replaces_verls(monkeypatch):
    # verl's FSDP engine looks the function up on the module at call time, so replacing it takes effect.
    assert "verl_F.calculate_sum_pi_squared_from_logits(" in inspect.getsource(transformer_impl)
    monkeypatch.setattr(
        verl_F, "calculate_sum_pi_squared_from_logits", verl_F.calculate_sum_pi_squared_from_logits
    )
    logits = (torch.randn(64, 4096, generator=torch.Generator().manual_seed(0)) * 4).bfloat16()
    exact = logits.double().softmax(-1).square().sum(-1)
    verl_error = (verl_F.calculate_sum_pi_squared_from_logits(logits).double() / exact - 1).abs().max()
    plugin.use_chunked_sum_pi_squared()
    got = verl_F.calculate_sum_pi_squared_from_logits(logits)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=0)
    torch.testing.assert_close(got, otbrl.sum_pi_squared(logits))
    assert verl_error > 1e-3  # verl's bf16 evaluation is visibly off; the replacement is not


def test_chunked_sum_pi_squared_is_opt_in(monkeypatch):
    monkeypatch.setattr(
        verl_F, "calculate_sum_pi_squared_from_logits", verl_F.calculate_sum_pi_squared_from_logits
    )
    original = verl_F.calculate_sum_pi_squared_from_logits
    monkeypatch.delenv(plugin.CHUNKED_ENV, raising=False)
    plugin.register()
    assert verl_F.calculate_sum_pi_squared_from_logits is original
    monkeypatch.setenv(plugin.CHUNKED_ENV, "1")
    plugin.register()
    assert verl_F.calculate_sum_pi_squared_from_logits is not original


def test_uid_arrays_of_any_hashable_group_rows():
    batch = verl_batch(2, [3, 3], 6, tool_tokens=False)
    fn = core_algos.get_adv_estimator_fn("otbrl_otb")
    a, _ = fn(**batch, config=None)
    b, _ = fn(**{**batch, "index": np.array([7, 7, 7, 9, 9, 9])}, config=None)
    torch.testing.assert_close(a, b)

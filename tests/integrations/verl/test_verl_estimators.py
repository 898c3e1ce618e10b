"""otbrl's estimators inside verl: the entry point registers them, the self-inclusive ones equal verl's own
OTB on random batches, leave-one-out differs as designed, options come from verl's algorithm config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
import torch
from omegaconf import OmegaConf
from verl.trainer.ppo import core_algos

import otbrl.integrations.verl as plugin
from tests.integrations.verl.batches import verl_batch
from tests.references import otb_ref

VERL_NAMES = {"otbrl_otb": "optimal_token_baseline", "otbrl_tir_otb": "tir_optimal_token_baseline"}


def test_entry_point_registers_estimators_and_trainer_mode():
    (point,) = [p for p in entry_points(group="verl.plugins") if p.name == "otbrl"]
    assert point.value == "otbrl.integrations.verl"
    probe = (
        "import json, verl\n"
        "from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY as R\n"
        "from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY as T\n"
        "print(json.dumps([{k: R[k].__module__ for k in R if k.startswith('otbrl')}, sorted(T)]))\n"
    )

    def registered(policy: str) -> list:
        env = {**os.environ, "VERL_USE_EXTERNAL_PLUGINS": policy, "OMP_NUM_THREADS": "1"}
        out = subprocess.run(
            [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
        )
        return json.loads(out.stdout.strip().splitlines()[-1])

    # A plain `import verl` loads the plugin through the entry point: nothing imports otbrl by hand.
    estimators, trainers = registered("auto")
    assert estimators == dict.fromkeys(plugin.VERL_ESTIMATORS, "otbrl.integrations.verl.estimators")
    assert plugin.TRAINER_MODE in trainers
    # With verl's plugin discovery off, nothing of otbrl's is there: the entry point did the work.
    estimators, trainers = registered("none")
    assert estimators == {} and plugin.TRAINER_MODE not in trainers


def test_chunked_sum_pi_squared_is_installed_at_import_when_asked():
    probe = (
        "import verl\n"
        "from verl.utils import torch_functional as F\n"
        "from verl.utils.experimental import torch_functional as E\n"
        "from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead as X\n"
        "print(F.calculate_sum_pi_squared_from_logits.__module__, E.FusedLinearForPPO.__name__,"
        " hasattr(X.prepare_model_outputs, 'otbrl_wrapped'))\n"
    )
    env = {**os.environ, plugin.CHUNKED_ENV: "1", "OMP_NUM_THREADS": "1"}
    env.pop("VERL_USE_EXTERNAL_PLUGINS", None)
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split()[-3:] == ["otbrl.integrations.verl", "FusedLinearWithSumPiSquared", "True"]


@pytest.mark.parametrize("name", sorted(VERL_NAMES))
@pytest.mark.parametrize("with_is", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_self_inclusive_equals_verl(name, with_is, seed):
    batch = verl_batch(seed, [4, 1, 3, 5], 12, tool_tokens=name == "otbrl_tir_otb")
    if not with_is:
        batch["rollout_is_weights"] = None
    mine_adv, mine_ret = core_algos.get_adv_estimator_fn(name)(**batch, config=None)
    ref_adv, ref_ret = core_algos.get_adv_estimator_fn(VERL_NAMES[name])(**batch, config=None)
    keep = batch["response_mask"].bool()
    assert mine_adv.dtype == torch.float32 and mine_adv.shape == ref_adv.shape
    torch.testing.assert_close(mine_adv, ref_adv * keep, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mine_ret[keep], ref_ret[keep], rtol=1e-6, atol=1e-6)
    assert mine_adv[keep].abs().max() > 0.05  # the comparison is not between two zero tensors


@pytest.mark.parametrize("name", ["otbrl_otb_loo", "otbrl_tir_otb_loo"])
@pytest.mark.parametrize("seed", range(3))
def test_leave_one_out_is_the_documented_estimator_and_differs_from_verl(name, seed):
    tir = name.startswith("otbrl_tir")
    batch = verl_batch(seed, [4, 3, 5], 10, tool_tokens=tir)
    adv, _ = core_algos.get_adv_estimator_fn(name)(**batch, config=None)
    mask = batch["response_mask"].bool()
    energy = (1 - 2 * batch["old_log_probs"].exp() + batch["sum_pi_squared"]).double()
    ref, _ = otb_ref(
        batch["token_level_rewards"].double(),
        mask,
        [int(u.split("-")[1]) for u in batch["index"]],
        energy,
        leave_one_out=True,
        align="generated" if tir else "position",
        is_weights=batch["rollout_is_weights"].double(),
    )
    torch.testing.assert_close(adv.double(), ref, rtol=1e-4, atol=1e-5)
    verl_adv, _ = core_algos.get_adv_estimator_fn(VERL_NAMES[name.removesuffix("_loo")])(**batch, config=None)
    assert (adv - verl_adv).abs().max() > 1e-2
    # The uniquely longest row (row 0) is alone on its tail: no one else to compare with, so A = G there.
    tail = mask[0] & (mask[1:4].sum(0) == 0) if not tir else None
    if tail is not None and tail.any():
        torch.testing.assert_close(
            adv[0, tail], batch["token_level_rewards"][0].sum().expand(int(tail.sum()))
        )


def test_options_come_from_the_algorithm_config():
    batch = verl_batch(0, [3, 4], 9, tool_tokens=False)
    otb = core_algos.get_adv_estimator_fn("otbrl_otb")
    config = OmegaConf.create({"adv_estimator": "otbrl_otb", "otbrl": {"leave_one_out": True}})
    loo = core_algos.get_adv_estimator_fn("otbrl_otb_loo")(**batch, config=None)[0]
    torch.testing.assert_close(otb(**batch, config=config)[0], loo)
    no_is = OmegaConf.create({"otbrl": {"use_is_weights": False}})
    plain = otb(**{**batch, "rollout_is_weights": None}, config=None)[0]
    torch.testing.assert_close(otb(**batch, config=no_is)[0], plain)
    assert (otb(**batch, config=None)[0] - plain).abs().max() > 1e-3
    with pytest.raises(ValueError, match="algorithm.otbrl.leave_one_ot"):
        otb(**batch, config=OmegaConf.create({"otbrl": {"leave_one_ot": True}}))


def test_rounded_statistics_keep_the_baseline_a_weighted_mean():
    # Row 0 is confident (pi_y = 0.999) and its Σπ² came back rounded 5e-6 low, as separately computed
    # statistics do: verl's 1 - 2 pi + Σπ² is negative there, row 1's is positive, and the group's
    # summed W nearly cancels. otbrl's energy is never negative, so its baseline stays a weighted mean
    # of the returns (within [0, 1] for rewards in {0, 1}).
    batch = verl_batch(0, [2], 4, tool_tokens=False)
    batch["response_mask"] = torch.ones(2, 4)
    batch["token_level_rewards"] = torch.tensor([[0.0, 0, 0, 1], [0, 0, 0, 0]])
    pi = torch.tensor([0.999, 1 - 4.1e-6**0.5])
    batch["old_log_probs"] = pi.log()[:, None].expand(2, 4).clone()
    batch["sum_pi_squared"] = (pi.square() - torch.tensor([5e-6, 0.0]))[:, None].expand(2, 4).clone()
    batch["rollout_is_weights"] = None
    assert (1 - 2 * batch["old_log_probs"].exp() + batch["sum_pi_squared"])[0].max() < 0
    returns = torch.tensor([[1.0] * 4, [0.0] * 4])
    adv, _ = core_algos.get_adv_estimator_fn("otbrl_otb")(**batch, config=None)
    verl_adv, _ = core_algos.get_adv_estimator_fn("optimal_token_baseline")(**batch, config=None)
    baseline, verl_baseline = returns - adv, returns - verl_adv
    assert baseline.min() >= 0 and baseline.max() <= 1
    assert verl_baseline.abs().max() > 2  # the failure this guards against


def test_reward_on_a_tool_token_moves_to_the_last_policy_token():
    batch = verl_batch(1, [3], 8, tool_tokens=False)
    mask = batch["response_mask"].bool()
    row_end = int(mask[0].nonzero().max())
    batch["token_level_rewards"][0, row_end] = 1.0
    batch["response_mask"][0, row_end] = 0.0  # the row's last token becomes a tool token
    adv, ret = core_algos.get_adv_estimator_fn("otbrl_otb")(**batch, config=None)
    r = 1.0
    kept = batch["response_mask"][0].bool()
    torch.testing.assert_close(ret[0, kept], torch.full((int(kept.sum()),), r))
    # verl's own estimator drops it: G = 0 on the row.
    _, verl_ret = core_algos.get_adv_estimator_fn("optimal_token_baseline")(**batch, config=None)
    assert float(verl_ret[0, kept].abs().max()) == 0.0


def test_missing_statistics_name_the_trainer_mode():
    batch = verl_batch(0, [2, 2], 4, tool_tokens=False)
    del batch["old_log_probs"], batch["sum_pi_squared"]
    with pytest.raises(ValueError, match="trainer_mode=otbrl_sync"):
        core_algos.get_adv_estimator_fn("otbrl_otb")(**batch, config=None)


@pytest.mark.parametrize("name", ["otbrl_otb_loo", "otbrl_tir_otb_loo"])
def test_leave_one_out_false_contradicts_a_loo_name(name):
    # It used to turn the "_loo" estimator silently into the self-inclusive form.
    batch = verl_batch(1, [3, 4], 9, tool_tokens=name.startswith("otbrl_tir"))
    estimator = core_algos.get_adv_estimator_fn(name)
    config = OmegaConf.create({"otbrl": {"leave_one_out": False}})
    with pytest.raises(ValueError, match="algorithm.otbrl.leave_one_out: false contradicts"):
        estimator(**batch, config=config)
    agreeing = OmegaConf.create({"otbrl": {"leave_one_out": True}})
    torch.testing.assert_close(estimator(**batch, config=agreeing)[0], estimator(**batch, config=None)[0])


def test_estimator_options_resolve_leave_one_out():
    assert plugin.estimator_options("otbrl_otb", None) == {"leave_one_out": False}
    assert plugin.estimator_options("otbrl_tir_otb_loo", {"otbrl": {"eps": 1e-6}}) == {
        "leave_one_out": True,
        "eps": 1e-6,
    }
    # The self-inclusive names may be switched (the documented way to pick LOO from the config).
    assert plugin.estimator_options("otbrl_otb", {"otbrl": {"leave_one_out": True}})["leave_one_out"]
    with pytest.raises(ValueError, match="contradicts adv_estimator 'otbrl_otb_loo'.*use 'otbrl_otb'"):
        plugin.estimator_options("otbrl_otb_loo", {"otbrl": {"leave_one_out": False}})
    with pytest.raises(ValueError, match="expected true or false"):
        plugin.estimator_options("otbrl_otb", {"otbrl": {"leave_one_out": "false"}})
    with pytest.raises(ValueError, match="name: unknown otbrl estimator"):
        plugin.estimator_options("otb", None)

"""The example config composes with verl's own Hydra config, every key it sets is one verl knows (a typo
would otherwise be merged in silently), and it selects otbrl's estimator and trainer mode."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir, initialize_config_module
from omegaconf import OmegaConf
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.v1 import get_trainer_cls

import otbrl.integrations.verl as plugin
from otbrl.integrations.verl.trainer import OTBPPOTrainerSync, check_config

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "verl"
# Keys verl's config does not have by design: otbrl's section and the environment for Ray workers.
OWN_KEYS = ("algorithm.otbrl.", "ray_kwargs.ray_init.runtime_env.env_vars.", "hydra.", "defaults")


def leaves(node, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        return [k for key, value in node.items() for k in leaves(value, f"{prefix}{key}.")]
    return [prefix.rstrip(".")]


def known(config, dotted: str) -> bool:
    """Whether verl's config has the key, whatever its value (null and ??? included)."""
    parent, _, last = dotted.rpartition(".")
    node = OmegaConf.select(config, parent) if parent else config
    return node is not None and last in node.keys()


def composed(name: str, overrides: list[str] | None = None):
    with initialize_config_dir(config_dir=str(EXAMPLE), version_base=None):
        return compose(config_name=name, overrides=overrides or [])


@pytest.fixture(scope="module")
def example():
    return composed("otb_gsm8k")


def test_example_sets_only_keys_verl_knows():
    own = OmegaConf.to_container(OmegaConf.load(EXAMPLE / "otb_gsm8k.yaml"))
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        base = compose(config_name="ppo_trainer")
    keys = [k for k in leaves(own) if not k.startswith(OWN_KEYS)]
    unknown = [k for k in keys if not known(base, k)]
    assert unknown == []
    assert "algorithm.otbrl.leave_one_out" in leaves(own)  # the filter above does not hide everything


def test_example_selects_otbrl(example):
    assert example.algorithm.adv_estimator in core_algos.ADV_ESTIMATOR_REGISTRY
    assert get_trainer_cls(example.trainer.v1.trainer_mode) is OTBPPOTrainerSync
    assert check_config(example) is True
    assert plugin.otbrl_options(example.algorithm) == {
        "leave_one_out": False,
        "zero_tail": True,
        "use_is_weights": True,
    }
    assert example.ray_kwargs.ray_init.runtime_env.env_vars[plugin.CHUNKED_ENV] == "1"
    # verl's own defaults are still there underneath.
    assert example.algorithm.gamma == 1.0 and example.actor_rollout_ref.rollout.n == 8


def test_one_override_switches_to_leave_one_out():
    config = composed("otb_gsm8k", ["algorithm.adv_estimator=otbrl_otb_loo"])
    assert plugin.VERL_ESTIMATORS[config.algorithm.adv_estimator] == ("position", True)
    assert check_config(config) is True

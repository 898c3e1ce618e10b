"""OTB inside TRL's GRPOTrainer: swap `GRPOConfig, GRPOTrainer` for `OTBGRPOConfig, OTBGRPOTrainer`.

`config` (OTBGRPOConfig), `trainer` (OTBGRPOTrainer), `callbacks` (surge detector and length-surge LR
decay kept in checkpoints), `rollout` (`rollout_func` for multi-turn tool rollouts). The adapter relies
on GRPOTrainer internals, so the TRL version is checked on import: older than the tested range, or a new
major release, is refused; a newer minor release runs with a warning that names the tested range.
"""

import warnings

import trl
from packaging.specifiers import SpecifierSet
from packaging.version import Version

TESTED_TRL = ("1.16", "1.17")  # [low, high): the range this adapter was tested with (the Makefile pins one)
# What the import check lets run, the tested range silently and a newer minor release with a warning; the
# `trl` extra of pyproject.toml states the same range (tests/integrations/test_trl_versions.py).
ACCEPTED_TRL = ">=1.16,<2"


def _check_trl_version(version: str | None = None) -> None:
    """An older TRL lacks what the adapter needs, and a new major release may remove the internals it
    relies on: both refused. A newer minor release runs with one loud warning, as the adapter relies on
    GRPOTrainer internals that a release may change. `version`: TRL's own unless given."""
    found_text = trl.__version__ if version is None else version
    low, high = TESTED_TRL
    found = Version(found_text)
    if not SpecifierSet(ACCEPTED_TRL).contains(found, prereleases=True):
        raise ImportError(
            f"otbrl.integrations.trl needs trl{ACCEPTED_TRL} (tested with trl>={low},<{high}); found trl "
            f"{found_text}. Install a tested version: pip install 'otbrl[trl]'"
        )
    if found >= Version(high):
        warnings.warn(
            f"otbrl.integrations.trl was tested with trl>={low},<{high} and relies on GRPOTrainer internals "
            f"(_generate_and_score_completions, _generate, _calculate_rewards, the old-log-prob pass, "
            f"get_off_policy_mask, get_gamma_weights); found trl {found_text}, not tested: check the "
            f"advantages it trains on, or install a tested version: pip install 'trl>={low},<{high}'",
            UserWarning,
            stacklevel=3,
        )


_check_trl_version()

from otbrl.integrations.trl.callbacks import LengthDecayCallback, SurgeCallback  # noqa: E402
from otbrl.integrations.trl.config import OTBGRPOConfig  # noqa: E402
from otbrl.integrations.trl.rollout import rollout_func, sampler_rollout_func  # noqa: E402
from otbrl.integrations.trl.trainer import OTBGRPOTrainer  # noqa: E402

__all__ = [
    "ACCEPTED_TRL",
    "TESTED_TRL",
    "LengthDecayCallback",
    "OTBGRPOConfig",
    "OTBGRPOTrainer",
    "SurgeCallback",
    "rollout_func",
    "sampler_rollout_func",
]

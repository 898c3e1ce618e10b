"""OTB inside TRL's GRPOTrainer: swap `GRPOConfig, GRPOTrainer` for `OTBGRPOConfig, OTBGRPOTrainer`.

`config` (OTBGRPOConfig), `trainer` (OTBGRPOTrainer), `callbacks` (surge detector and length-surge LR
decay kept in checkpoints), `rollout` (`rollout_func` for multi-turn tool rollouts). The adapter relies
on GRPOTrainer internals, so the TRL version is checked on import: older than the tested range is
refused, newer runs with a warning that names the tested range.
"""

import warnings

import trl
from packaging.version import Version

TESTED_TRL = ("1.16", "1.17")  # [low, high): the range this adapter was tested with


def _check_trl_version() -> None:
    """An older TRL lacks what the adapter needs: refused. A newer one runs with one loud warning, as
    the adapter relies on GRPOTrainer internals that a release may change."""
    low, high = TESTED_TRL
    found = Version(trl.__version__)
    if found < Version(low):
        raise ImportError(
            f"otbrl.integrations.trl needs trl>={low} (tested with trl>={low},<{high}); found trl "
            f"{trl.__version__}. Install a tested version: pip install 'otbrl[trl]'"
        )
    if found >= Version(high):
        warnings.warn(
            f"otbrl.integrations.trl was tested with trl>={low},<{high} and relies on GRPOTrainer internals "
            f"(_generate_and_score_completions, _generate, _calculate_rewards, the old-log-prob pass, "
            f"get_off_policy_mask, get_gamma_weights); found trl {trl.__version__}, not tested: check the "
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
    "TESTED_TRL",
    "LengthDecayCallback",
    "OTBGRPOConfig",
    "OTBGRPOTrainer",
    "SurgeCallback",
    "rollout_func",
    "sampler_rollout_func",
]

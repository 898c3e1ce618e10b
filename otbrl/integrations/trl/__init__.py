"""OTB inside TRL's GRPOTrainer: swap `GRPOConfig, GRPOTrainer` for `OTBGRPOConfig, OTBGRPOTrainer`.

`config` (OTBGRPOConfig), `trainer` (OTBGRPOTrainer), `callbacks` (surge detector and length-surge LR
decay kept in checkpoints), `rollout` (`rollout_func` for multi-turn tool rollouts). The adapter relies
on GRPOTrainer internals, so the TRL version is checked on import.
"""

TESTED_TRL = ("1.16", "1.17")  # [low, high): the range this adapter was tested with


def _check_trl_version() -> None:
    import trl
    from packaging.version import Version

    low, high = TESTED_TRL
    if not Version(low) <= Version(trl.__version__) < Version(high):
        raise ImportError(
            f"otbrl.integrations.trl was tested with trl>={low},<{high} and relies on its GRPOTrainer "
            f"internals; found trl {trl.__version__}. Install a tested version: pip install 'otbrl[trl]'"
        )


_check_trl_version()

from otbrl.integrations.trl.callbacks import LengthDecayCallback, SurgeCallback  # noqa: E402
from otbrl.integrations.trl.config import OTBGRPOConfig  # noqa: E402
from otbrl.integrations.trl.rollout import rollout_func  # noqa: E402
from otbrl.integrations.trl.trainer import OTBGRPOTrainer  # noqa: E402

__all__ = [
    "TESTED_TRL",
    "LengthDecayCallback",
    "OTBGRPOConfig",
    "OTBGRPOTrainer",
    "SurgeCallback",
    "rollout_func",
]

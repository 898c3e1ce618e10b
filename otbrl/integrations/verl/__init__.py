"""otbrl's OTB inside verl: advantage estimators under verl's calling convention, and the Σπ² plumbing.

verl imports this module through the `verl.plugins` entry point (or `VERL_USE_EXTERNAL_MODULES`), which
registers the estimators below. verl's default V1 trainer never requests or forwards Σπ², so the
`otbrl_sync` trainer mode (`trainer.v1.trainer_mode=otbrl_sync`) asks the actor for it with the old
log-probs and hands both to the estimator. See docs/verl.md.
"""

from __future__ import annotations

import contextlib
import os

import torch

from otbrl.energy import sum_pi_squared
from otbrl.integrations.verl.common import (
    CHUNKED_ENV,
    STATS_FIELD,
    TRAINER_MODE,
    VERL_ESTIMATORS,
    token_stats,
)
from otbrl.integrations.verl.estimators import estimator_options, otbrl_options, register_estimators

__all__ = [
    "CHUNKED_ENV",
    "STATS_FIELD",
    "TRAINER_MODE",
    "VERL_ESTIMATORS",
    "estimator_options",
    "otbrl_options",
    "register",
    "token_stats",
    "use_chunked_sum_pi_squared",
]


def register() -> None:
    """Register otbrl's estimators with verl (idempotent), the trainer mode where verl's V1 trainer is
    importable, and, if OTBRL_VERL_CHUNKED_SUM_PI_SQ=1, otbrl's chunked Σπ² in place of verl's."""
    register_estimators()
    with contextlib.suppress(ImportError):  # V1 needs TransferQueue; without it only the estimators
        from otbrl.integrations.verl import trainer as verl_trainer  # noqa: F401  (registers the trainer mode)
    if os.environ.get(CHUNKED_ENV, "0") == "1":
        use_chunked_sum_pi_squared()


def _chunked_sum_pi_squared(logits: torch.Tensor) -> torch.Tensor:
    # verl calls it with logits already divided by the temperature, hence no temperature here.
    return sum_pi_squared(logits)


def use_chunked_sum_pi_squared() -> None:
    """Compute Σπ² in verl's actor with otbrl's chunked passes: from the logits with float32
    accumulation and one working tile instead of full float32 copies of the (tokens, vocab) logits,
    and, with verl's fused kernels on (where verl refuses), from the hidden states and output head."""
    # On demand (OTBRL_VERL_CHUNKED_SUM_PI_SQ=1): the fused module patches verl's actor internals
    from verl.utils import torch_functional

    from otbrl.integrations.verl import fused as verl_fused

    torch_functional.calculate_sum_pi_squared_from_logits = _chunked_sum_pi_squared
    verl_fused.install()


register()

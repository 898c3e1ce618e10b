"""otbrl: the Optimal Token Baseline for LLM reinforcement learning.

The core is framework-free (torch only): per-token energy from logits (`otbrl.energy`), grouped
advantage estimators (`otbrl.estimators`), forward-only diagnostics and an exact reference.
"""

from otbrl.energy import (
    TokenStats,
    fused_token_stats,
    realized_energy,
    sum_pi_squared,
    token_energy,
    token_energy_from_logprobs,
)
from otbrl.estimators import ESTIMATORS, AdvantageResult, compute_advantages, register_estimator

from otbrl import diagnostics, exact  # isort: skip  (exact registers the "otb_exact" estimator)

__all__ = [
    "diagnostics",
    "exact",
    "ESTIMATORS",
    "AdvantageResult",
    "compute_advantages",
    "fused_token_stats",
    "TokenStats",
    "realized_energy",
    "register_estimator",
    "sum_pi_squared",
    "token_energy",
    "token_energy_from_logprobs",
]
__version__ = "0.1.0"

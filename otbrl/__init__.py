"""otbrl: the Optimal Token Baseline for LLM reinforcement learning.

The library is framework-free (torch only): per-token energy from logits (`otbrl.energy`) or from hidden
states and the output head (`otbrl.fused`), grouped advantage estimators (`otbrl.estimators`),
policy-gradient losses (`otbrl.losses`), stability diagnostics (`otbrl.stability`) and an exact
reference (`otbrl.exact`). Generation (`otbrl.rollout`), tools (`otbrl.tools`) and the TRL and verl
adapters (`otbrl.integrations`) load their heavy dependencies on import; the `otbrl` command lives in
`otbrl.app`. (The project's evidence suite is the repository's `studies/`, outside the package.)
"""

from otbrl.energy import realized_energy, sum_pi_squared, token_energy, token_energy_from_logprobs
from otbrl.estimators import ESTIMATORS, AdvantageResult, compute_advantages, register_estimator
from otbrl.fused import fused_token_stats
from otbrl.losses import PolicyLoss, policy_gradient_loss, policy_gradient_loss_with_stats
from otbrl.stats import TokenStats

from otbrl import exact, stability  # isort: skip  (exact registers the "otb_exact" estimator)

__all__ = [
    "ESTIMATORS",
    "AdvantageResult",
    "PolicyLoss",
    "TokenStats",
    "compute_advantages",
    "exact",
    "fused_token_stats",
    "policy_gradient_loss",
    "policy_gradient_loss_with_stats",
    "realized_energy",
    "register_estimator",
    "stability",
    "sum_pi_squared",
    "token_energy",
    "token_energy_from_logprobs",
]
__version__ = "0.1.0"

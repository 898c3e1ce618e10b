"""Forward-only training diagnostics: energy and advantage statistics per batch, the exact logit-space
squared norm of each trajectory's update, and a gradient-norm surge detector for any training loop.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any

import torch

from otbrl.batch import check_mask, check_token_values


def update_energy(advantages: torch.Tensor, energy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Logit-space squared norm of each trajectory's update, sum_t A_t^2 w_t m_t.

    The update of token t moves its logits by A_t (e_y - pi_t); tokens own disjoint logit vectors, so
    the squared norm has no cross terms. advantages, energy, mask: (B, T). Returns (B,) float64.
    Unlike a parameter-space gradient norm, this is in the same units as the energy itself.
    """
    keep = check_mask(mask)
    a = check_token_values("advantages", advantages, keep)
    w = check_token_values("energy", energy, keep, nonnegative=True)
    return (a.square() * w).sum(dim=-1)


def batch_diagnostics(advantages: torch.Tensor, energy: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Scalars to log once per batch (all over policy tokens, or over non-empty trajectories).

    energy/mean: mean per-token energy w_t.  energy/traj_mean: mean realized energy W_T per trajectory.
    adv/mean, adv/mean_sq, adv/abs_max: advantage statistics.
    update_energy/mean, update_energy/max: sum_t A_t^2 w_t per trajectory (see `update_energy`).
    """
    keep = check_mask(mask)
    a = check_token_values("advantages", advantages, keep)
    w = check_token_values("energy", energy, keep, nonnegative=True)
    tokens = keep.sum().item()
    rows = keep.any(dim=-1)
    n_rows = rows.sum().item()
    per_row = (a.square() * w).sum(dim=-1)[rows]

    def mean(total: torch.Tensor, count: float) -> float:
        return total.item() / count if count else 0.0

    return {
        "energy/mean": mean(w.sum(), tokens),
        "energy/traj_mean": mean(w.sum(dim=-1)[rows].sum(), n_rows),
        "adv/mean": mean(a.sum(), tokens),
        "adv/mean_sq": mean(a.square().sum(), tokens),
        "adv/abs_max": a.abs().max().item() if tokens else 0.0,
        "update_energy/mean": mean(per_row.sum(), n_rows),
        "update_energy/max": per_row.max().item() if n_rows else 0.0,
    }


class SurgeDetector:
    """Flags a step whose gradient norm exceeds `factor` times the median of the last `window` norms.

    Call `update(norm)` once per optimiser step; it returns True on a surge. Nothing fires during the
    first `warmup` steps. Surging values enter the history too, so a lasting new level stops firing
    after about window / 2 steps. A non-finite norm is always a surge. `state_dict` / `load_state_dict`
    carry the history through checkpoints.
    """

    def __init__(self, factor: float = 3.0, window: int = 50, warmup: int = 10) -> None:
        if not (factor > 1):
            raise ValueError(f"factor: must be > 1, got {factor!r}")
        if window < 1 or warmup < 1:
            raise ValueError(f"window and warmup: must be >= 1, got window={window!r}, warmup={warmup!r}")
        self.factor, self.window, self.warmup = float(factor), int(window), int(warmup)
        self.history: deque[float] = deque(maxlen=self.window)
        self.steps = 0
        self.surges: list[int] = []  # step numbers (0-based) that fired

    def update(self, norm: float | torch.Tensor) -> bool:
        value = float(norm)
        surge = not math.isfinite(value)
        if not surge and self.steps >= self.warmup and self.history:
            surge = value > self.factor * statistics.median(self.history)
        if math.isfinite(value):
            self.history.append(value)
        if surge:
            self.surges.append(self.steps)
        self.steps += 1
        return surge

    def state_dict(self) -> dict[str, Any]:
        return {
            "factor": self.factor,
            "window": self.window,
            "warmup": self.warmup,
            "history": list(self.history),
            "steps": self.steps,
            "surges": list(self.surges),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.__init__(state["factor"], state["window"], state["warmup"])
        self.history.extend(state["history"])
        self.steps, self.surges = int(state["steps"]), list(state["surges"])

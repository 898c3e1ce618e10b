"""Validation of estimator input, and the clean (B, T) `Rollouts` view that every estimator receives.

All checks on user input live here (with the one compute-dtype rule), so each estimator can assume
finite, masked float tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from otbrl.groups import dense_group_index


@dataclass(frozen=True)
class Rollouts:
    """A validated batch. B trajectories, T token positions, G prompt groups.

    mask:     (B, T) bool, True where the policy generated the token.
    returns:  (B, T) reward-to-go G_t = sum_{s>=t} r_s m_s, zero where mask is False.
    outcome:  (B,) total return of each trajectory (the reward for outcome-reward tasks).
    group:    (B,) long dense group index in [0, G).
    n_groups: G.
    energy:   (B, T) per-token energy w_t (>= 0), zero where mask is False; None if not given.
    Float tensors are float32, or float64 when rewards or energy came in float64 (`dtype`).
    """

    mask: torch.Tensor
    returns: torch.Tensor
    outcome: torch.Tensor
    group: torch.Tensor
    n_groups: int
    energy: torch.Tensor | None

    @property
    def dtype(self) -> torch.dtype:
        return self.returns.dtype

    @property
    def lengths(self) -> torch.Tensor:
        """(B,) number of policy tokens per trajectory, in `dtype`."""
        return self.mask.sum(dim=-1, dtype=self.dtype)

    @property
    def group_sizes(self) -> torch.Tensor:
        """(B,) long: how many trajectories share each row's group."""
        return torch.bincount(self.group, minlength=self.n_groups)[self.group]


def _as_tensor(name: str, value: Any, device: torch.device | None = None) -> torch.Tensor:
    if value is None:
        raise ValueError(f"{name}: is required")
    try:
        t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"{name}: cannot be read as a tensor ({err})") from None
    return t if device is None else t.to(device)


def check_mask(mask: Any) -> torch.Tensor:
    """(B, T) tensor of 0/1 (bool, integer or float) -> bool tensor."""
    mask = _as_tensor("mask", mask)
    if mask.dim() != 2:
        raise ValueError(f"mask: expected shape (B, T), got {tuple(mask.shape)}")
    if mask.dtype != torch.bool:
        if mask.is_complex():
            raise ValueError("mask: values must be 0 or 1")
        keep = mask != 0
        if (keep & (mask != 1)).any():
            raise ValueError("mask: values must be 0 or 1")
        mask = keep
    return mask


def check_temperature(temperature: Any) -> None:
    """Sampling temperatures must be finite numbers > 0 (booleans are not numbers here)."""
    if isinstance(temperature, bool) or not (
        isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0
    ):
        raise ValueError(f"temperature: must be a finite number > 0, got {temperature!r}")


def compute_dtype(*values: Any) -> torch.dtype:
    """The one precision rule of otbrl: float64 if any given tensor (or dtype) is float64, else float32
    (whatever lower precision came in: bf16 and fp16 are accumulated in float32)."""
    wide = any(getattr(v, "dtype", v) == torch.float64 for v in values)
    return torch.float64 if wide else torch.float32


def _check_range(name: str, t: torch.Tensor, nonnegative: bool, where: str) -> None:
    if t.numel() == 0:
        return
    low, high = torch.aminmax(t)  # one pass; both propagate NaN
    if not (torch.isfinite(low) and torch.isfinite(high)):
        raise ValueError(f"{name}: contains NaN or inf{where}")
    if nonnegative and low < 0:
        raise ValueError(
            f"{name}: must be >= 0{where} (min {low.item():.3g}); if it comes from "
            "1 - 2*pi + sum(pi^2), use otbrl.token_energy_from_logprobs, which clamps the rounding error"
        )


def check_token_values(
    name: str, value: Any, mask: torch.Tensor, *, nonnegative: bool = False, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """A (B, T) per-token real tensor, read only where mask is True -> `dtype` (default: float32, or
    float64 for float64 input), zero elsewhere."""
    t = _as_tensor(name, value, mask.device)
    if t.shape != mask.shape:
        raise ValueError(f"{name}: shape {tuple(t.shape)} does not match mask {tuple(mask.shape)}")
    if not (
        t.is_floating_point() or t.dtype in (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)
    ):
        raise ValueError(f"{name}: expected a real-valued tensor, got {t.dtype}")
    t = torch.where(mask, t.to(dtype or compute_dtype(t)), 0.0)
    _check_range(name, t, nonnegative, " at policy tokens")
    return t


def check_rewards(
    rewards: Any, mask: torch.Tensor, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) outcome or (B, T) token rewards -> (returns (B, T), outcome (B,)) in `dtype`."""
    r = _as_tensor("rewards", rewards, mask.device)
    if r.is_complex() or r.dtype == torch.bool:
        raise ValueError(f"rewards: expected real numbers, got {r.dtype}")
    r = r.to(dtype or compute_dtype(r))
    _check_range("rewards", r, False, "")
    batch = mask.shape[0]
    if r.dim() == 1:
        if r.shape[0] != batch:
            raise ValueError(f"rewards: length {r.shape[0]} does not match the batch size {batch} of mask")
        # The outcome reward sits on the last policy token, so every policy token's reward-to-go is R.
        return torch.where(mask, r[:, None], 0.0), r
    if r.shape != mask.shape:
        raise ValueError(
            f"rewards: expected shape (B,) or (B, T) = {tuple(mask.shape)}, got {tuple(r.shape)}"
        )
    lost = (r != 0) & ~mask
    if lost.any():
        row, col = (int(i) for i in lost.nonzero()[0])
        raise ValueError(
            f"rewards: {int(lost.sum())} nonzero token reward(s) sit on mask == 0 positions (first at row "
            f"{row}, position {col}) and would be dropped; put an outcome reward on the last policy token "
            "(otbrl.inputs.rewards_onto_policy_tokens moves each reward there)"
        )
    returns = r.flip(-1).cumsum(-1).flip(-1)
    return torch.where(mask, returns, 0.0), r.sum(dim=-1)


def rewards_onto_policy_tokens(rewards: Any, mask: Any) -> torch.Tensor:
    """(B, T) token rewards -> the same rewards with each one that sits on a mask == 0 token (a tool
    token, or padding after the response) moved onto the last policy token at or before it, which is
    where `compute_advantages` expects it. Rewards with no policy token before them (a row with none)
    are dropped, as such a row has no token to credit."""
    mask = check_mask(mask)
    rewards = _as_tensor("rewards", rewards, mask.device)
    if rewards.shape != mask.shape:
        raise ValueError(f"rewards: shape {tuple(rewards.shape)} does not match mask {tuple(mask.shape)}")
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last_policy = torch.where(mask, positions, -1).cummax(dim=-1).values
    off = torch.where(mask | (last_policy < 0), 0.0, rewards)
    moved = torch.zeros_like(off).scatter_add_(-1, last_policy.clamp_min(0), off)
    return torch.where(mask, rewards, 0.0) + moved


def make_rollouts(*, rewards: Any, mask: Any, group_ids: Any, energy: Any = None) -> Rollouts:
    """Validate user input and build the `Rollouts` view."""
    mask = check_mask(mask)
    dtype = compute_dtype(rewards, energy)
    returns, outcome = check_rewards(rewards, mask, dtype)
    group, n_groups = dense_group_index(group_ids, mask.shape[0], mask.device)
    w = None if energy is None else check_token_values("energy", energy, mask, nonnegative=True, dtype=dtype)
    return Rollouts(mask=mask, returns=returns, outcome=outcome, group=group, n_groups=n_groups, energy=w)

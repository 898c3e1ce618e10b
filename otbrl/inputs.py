"""Validation of estimator input, and the clean (B, T) `Rollouts` view that every estimator receives.

All checks on user input live here (with the one compute-dtype rule), so each estimator can assume
finite, masked float tensors.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch

from otbrl.groups import dense_group_index, group_sums


@dataclass(frozen=True)
class Rollouts:
    """A validated batch. B trajectories, T token positions, G prompt groups.

    mask:     (B, T) bool, True where the policy generated the token.
    returns:  (B, T) reward-to-go G_t = sum_{s>=t} r_s m_s, zero where mask is False.
    outcome:  (B,) total return of each trajectory (the reward for outcome-reward tasks).
    group:    (B,) long dense group index in [0, G).
    n_groups: G.
    energy:   (B, T) per-token energy w_t (>= 0), zero where mask is False; None if not given.
    weights:  (B, T) the mask as 0.0 / 1.0 in `dtype` (None: derived from mask on first use). Masking by
              multiplying with it is several times faster on CPU than torch.where on the bool mask, and
              exact for the finite values estimators hold.
    Float tensors are float32, or float64 when rewards or energy came in float64 (`dtype`).

    Group membership (one rule for every estimator): a row with no policy token (mask all zero, e.g. a
    row a trainer could not score and masked out) belongs to no group. It gets zero advantages, and
    group sizes, means, variances and baselines are taken over the member rows only.
    """

    mask: torch.Tensor
    returns: torch.Tensor
    outcome: torch.Tensor
    group: torch.Tensor
    n_groups: int
    energy: torch.Tensor | None
    weights: torch.Tensor | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.returns.dtype

    @cached_property
    def mask_values(self) -> torch.Tensor:
        """(B, T) the mask as 0.0 / 1.0 in `dtype`."""
        if self.weights is not None and self.weights.dtype == self.dtype:
            return self.weights
        return as_values(self.mask, self.dtype)

    @cached_property
    def lengths(self) -> torch.Tensor:
        """(B,) number of policy tokens per trajectory, in `dtype`."""
        return self.mask_values.sum(dim=-1)

    @cached_property
    def members(self) -> torch.Tensor:
        """(B,) bool: rows with at least one policy token, the only rows that count in their group."""
        return self.lengths > 0

    @cached_property
    def group_counts(self) -> torch.Tensor:
        """(G,) long: member rows per group."""
        return group_sums(self.members, self.group, self.n_groups)

    @property
    def group_sizes(self) -> torch.Tensor:
        """(B,) long: how many member rows share each row's group."""
        return self.group_counts[self.group]


def _as_tensor(name: str, value: Any, device: torch.device | None = None) -> torch.Tensor:
    if value is None:
        raise ValueError(f"{name}: is required")
    try:
        t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"{name}: cannot be read as a tensor ({err})") from None
    return t if device is None else t.to(device)


def _mask_and_values(mask: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Validated mask as (bool (B, T), the tensor as given)."""
    mask = _as_tensor("mask", mask)
    if mask.dim() != 2:
        raise ValueError(f"mask: expected shape (B, T), got {tuple(mask.shape)}")
    if mask.dtype == torch.bool:
        return mask, mask
    if mask.is_complex():
        raise ValueError("mask: values must be 0 or 1")
    keep = mask.bool()
    # Casts, one reduction and one comparison of bytes: much cheaper on CPU than comparisons with a
    # bool output. In [0, 1] (NaN fails here), a value is 0 or 1 exactly when truncating it to an
    # integer gives what bool() gives (0.5 -> 0 but True).
    if mask.numel():
        low, high = torch.aminmax(mask)
        if not (low >= 0 and high <= 1):
            raise ValueError("mask: values must be 0 or 1")
        if not torch.equal(keep.view(torch.uint8), mask.to(torch.uint8)):
            raise ValueError("mask: values must be 0 or 1")
    return keep, mask


def as_values(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, T) bool -> 0.0 / 1.0 in a float `dtype`. Through uint8: on CPU a bool -> float cast is
    several times slower than a uint8 -> float one."""
    return mask.view(torch.uint8).to(dtype)


def check_mask(mask: Any) -> torch.Tensor:
    """(B, T) tensor of 0/1 (bool, integer or float) -> bool tensor."""
    return _mask_and_values(mask)[0]


def check_temperature(temperature: Any) -> float:
    """Sampling temperatures must be finite real numbers > 0: Python, numpy or 0-d tensor reals
    (booleans are not numbers here). Returns it as a Python float."""
    value = temperature
    if isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype != torch.bool:
        value = value.item()
    elif isinstance(value, np.generic) and not isinstance(value, np.bool_):
        value = value.item()
    ok = (
        isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    )
    if not ok:
        raise ValueError(f"temperature: must be a finite number > 0, got {temperature!r}")
    return float(value)


def _is_float64(dtype: Any) -> bool:
    """A torch or numpy dtype that is float64 (a numpy float64 array counts as float64 input)."""
    if isinstance(dtype, torch.dtype):
        return dtype == torch.float64
    return isinstance(dtype, np.dtype) and dtype == np.float64


def compute_dtype(*values: Any) -> torch.dtype:
    """The one precision rule of otbrl: float64 if any given tensor (or dtype) is float64, else float32
    (whatever lower precision came in: bf16 and fp16 are accumulated in float32)."""
    wide = any(_is_float64(getattr(v, "dtype", v)) for v in values)
    return torch.float64 if wide else torch.float32


def _check_range(name: str, t: torch.Tensor, nonnegative: bool, where: str) -> float:
    """Raise unless t is finite (and >= 0 if asked); returns max |t| (0 for an empty tensor)."""
    if t.numel() == 0:
        return 0.0
    low, high = torch.aminmax(t)  # one pass; both propagate NaN
    if not (torch.isfinite(low) and torch.isfinite(high)):
        raise ValueError(f"{name}: contains NaN or inf{where}")
    if nonnegative and low < 0:
        raise ValueError(
            f"{name}: must be >= 0{where} (min {low.item():.3g}); if it comes from "
            "1 - 2*pi + sum(pi^2), use otbrl.token_energy_from_logprobs, which clamps the rounding error"
        )
    return max(abs(float(low)), abs(float(high)))


def _real(name: str, value: Any, device: torch.device) -> torch.Tensor:
    t = _as_tensor(name, value, device)
    if t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{name}: expected real numbers, got {t.dtype}")
    return t


def _masked(t: torch.Tensor, mask: torch.Tensor, values: torch.Tensor | None) -> torch.Tensor:
    """t where mask, 0 elsewhere. With `values` (the mask as 0/1 in t's dtype) by a multiplication,
    several times faster than torch.where on CPU; anything non-finite at a masked position would turn
    into NaN there, so the caller rechecks with torch.where when the product is not finite."""
    if values is None or values.dtype != t.dtype:
        return torch.where(mask, t, 0.0)
    return t * values


def check_token_values(
    name: str,
    value: Any,
    mask: torch.Tensor,
    *,
    nonnegative: bool = False,
    dtype: torch.dtype | None = None,
    values: torch.Tensor | None = None,
) -> torch.Tensor:
    """A (B, T) per-token real tensor, read only where mask is True -> `dtype` (default: float32, or
    float64 for float64 input), zero elsewhere. `values`: optionally the mask as 0/1 in `dtype`."""
    return _token_values(name, value, mask, nonnegative, dtype, values)[0]


def _token_values(
    name: str,
    value: Any,
    mask: torch.Tensor,
    nonnegative: bool,
    dtype: torch.dtype | None,
    values: torch.Tensor | None,
) -> tuple[torch.Tensor, float]:
    """check_token_values, plus the largest magnitude at policy tokens."""
    t = _as_tensor(name, value, mask.device)
    if t.shape != mask.shape:
        raise ValueError(f"{name}: shape {tuple(t.shape)} does not match mask {tuple(mask.shape)}")
    if not (
        t.is_floating_point() or t.dtype in (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)
    ):
        raise ValueError(f"{name}: expected a real-valued tensor, got {t.dtype}")
    t = t.to(dtype or compute_dtype(t))
    out = _masked(t, mask, values)
    try:
        largest = _check_range(name, out, nonnegative, " at policy tokens")
    except ValueError:
        if out is t or values is None:
            raise
        # Maybe only a NaN or inf at a masked position (never read) spoiled the product.
        out = torch.where(mask, t, 0.0)
        largest = _check_range(name, out, nonnegative, " at policy tokens")
    return out, largest


# float32 sums, squares and products of values up to this size stay far from overflow for any batch
# (|x| <= 1e15 gives x^2 * 1e6 rows << 3.4e38); bigger inputs are computed in float64 instead.
SAFE_FLOAT32 = 1e15


def check_rewards(
    rewards: Any, mask: torch.Tensor, dtype: torch.dtype | None = None, values: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) outcome or (B, T) token rewards -> (returns (B, T), outcome (B,)) in `dtype`.
    `values`: optionally the mask as 0/1 in `dtype`."""
    returns, outcome, _ = _rewards(rewards, mask, dtype, values)
    return returns, outcome


def _rewards(
    rewards: Any, mask: torch.Tensor, dtype: torch.dtype | None, values: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """check_rewards, plus a bound on |reward-to-go|: T * max |r| (max |r| for outcome rewards)."""
    r = _real("rewards", rewards, mask.device)
    r = r.to(dtype or compute_dtype(r))
    largest = _check_range("rewards", r, False, "")
    batch = mask.shape[0]
    if r.dim() == 1:
        if r.shape[0] != batch:
            raise ValueError(f"rewards: length {r.shape[0]} does not match the batch size {batch} of mask")
        # The outcome reward sits on the last policy token, so every policy token's reward-to-go is R.
        return _masked(r[:, None].expand(mask.shape), mask, values), r, largest
    if r.shape != mask.shape:
        raise ValueError(
            f"rewards: expected shape (B,) or (B, T) = {tuple(mask.shape)}, got {tuple(r.shape)}"
        )
    kept = _masked(r, mask, values)
    if not torch.equal(kept, r):
        lost = (r != 0) & ~mask
        row, col = (int(i) for i in lost.nonzero()[0])
        raise ValueError(
            f"rewards: {int(lost.sum())} nonzero token reward(s) sit on mask == 0 positions (first at row "
            f"{row}, position {col}) and would be dropped; put an outcome reward on the last policy token "
            "(otbrl.inputs.rewards_onto_policy_tokens moves each reward there)"
        )
    # Reward-to-go, in place where a copy exists anyway. It may overflow float32 only beyond the bound
    # returned, where make_rollouts starts over in float64.
    returns = kept.flip(-1).cumsum_(-1).flip(-1)
    returns = torch.where(mask, returns, 0.0) if values is None else returns.mul_(values)
    return returns, r.sum(dim=-1), largest * mask.shape[-1]


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
    """Validate user input and build the `Rollouts` view.

    Computes in float32 (float64 if rewards or energy are float64), and in float64 also when the
    reward-to-go or the summed energy could get near float32's range (extreme but finite input: T times
    the largest |reward| or energy above SAFE_FLOAT32), so that sums and squares never overflow."""
    mask, given = _mask_and_values(mask)
    group, n_groups = dense_group_index(group_ids, mask.shape[0], mask.device)
    dtype = compute_dtype(rewards, energy)
    while True:
        values = given.detach() if given.dtype == dtype else as_values(mask, dtype)
        returns, outcome, largest = _rewards(rewards, mask, dtype, values)
        w = None
        if energy is not None:
            w, most = _token_values("energy", energy, mask, True, dtype, values)
            largest = max(largest, most * mask.shape[-1])
        if dtype == torch.float64 or not largest > SAFE_FLOAT32:
            break
        dtype = torch.float64  # rare: validate and build again, wide
    return Rollouts(
        mask=mask, returns=returns, outcome=outcome, group=group, n_groups=n_groups, energy=w, weights=values
    )

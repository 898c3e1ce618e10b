"""Advantage estimators behind one contract, a registry, and `compute_advantages`.

An estimator takes a validated `Rollouts` batch plus keyword options and returns (B, T) advantages
and baselines. Every estimator gives a group of one trajectory no baseline (A = G).
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from otbrl.groups import aligned_columns, from_frame, group_sums, rows_of, to_frame
from otbrl.inputs import Rollouts, check_token_values, make_rollouts

EstimatorFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class EstimatorSpec:
    """A registered estimator. `needs_energy`: reads per-token energy; `needs_model`: computes its own
    inputs from a model (e.g. otb_exact), so a trainer cannot feed it from rollouts alone. `defaults`:
    the options' keyword defaults, whose types a given value must have (see `resolve`)."""

    name: str
    fn: EstimatorFn
    needs_energy: bool
    options: tuple[str, ...]
    masked_output: bool
    needs_model: bool = False
    defaults: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class AdvantageResult:
    """Output of `compute_advantages`; each field is (B, T) float32 and zero where mask == 0."""

    advantages: torch.Tensor
    returns: torch.Tensor
    baselines: torch.Tensor


ESTIMATORS: dict[str, EstimatorSpec] = {}


def register_estimator(
    name: str,
    *,
    needs_energy: bool = False,
    options: tuple[str, ...] | None = None,
    masked_output: bool = False,
    needs_model: bool = False,
) -> Callable[[EstimatorFn], EstimatorFn]:
    """Decorator: register `fn(batch: Rollouts, **options) -> (advantages, baselines)` under `name`.

    Both outputs are (B, T) tensors; `compute_advantages` zeroes them where mask == 0 (skipped when
    `masked_output` promises fn already does, which saves a pass over (B, T)) and converts them to
    float32. Set `needs_energy` when fn reads `batch.energy`. The accepted option names are fn's
    keyword-only parameters, unless `options` lists them (for an fn that forwards **kwargs). Set
    `needs_model` when fn needs a model among its options (trainers then refuse it).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name: expected a non-empty string, got {name!r}")

    def decorate(fn: EstimatorFn) -> EstimatorFn:
        if name in ESTIMATORS:
            raise ValueError(f"name: an estimator called {name!r} is already registered")
        params = list(inspect.signature(fn).parameters.values())[1:]
        names = options or tuple(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)
        defaults = {p.name: p.default for p in params if p.name in names and p.default is not p.empty}
        spec = EstimatorSpec(name, fn, needs_energy, tuple(names), masked_output, needs_model, defaults)
        ESTIMATORS[name] = spec
        return fn

    return decorate


def resolve(estimator: Any, options: Any = None, *, from_rollouts: bool = False) -> EstimatorSpec:
    """The spec of a registered estimator, after checking its options: the one place of the option
    rules, which `compute_advantages`, recipes and every trainer adapter (TRL, verl) run. Option names
    must be the estimator's; given a mapping, each value must have the type of its keyword default (a
    quoted "false" is no boolean: it would be truthy). With `from_rollouts`, estimators that need a model
    of their own (`needs_model`) are refused, as a trainer feeds estimators from rollouts."""
    spec = ESTIMATORS.get(estimator) if isinstance(estimator, str) else None
    if spec is None or (from_rollouts and spec.needs_model):
        usable = sorted(n for n, s in ESTIMATORS.items() if not (from_rollouts and s.needs_model))
        what = "unknown" if spec is None else "needs a model of its own, so a trainer cannot use"
        raise ValueError(f"estimator: {what} estimator {estimator!r}; known: {', '.join(usable)}")
    unknown = sorted(set(options or ()) - set(spec.options))
    if unknown:
        accepted = ", ".join(spec.options) or "none"
        raise ValueError(f"{unknown[0]}: not an option of estimator {estimator!r} (its options: {accepted})")
    if isinstance(options, Mapping):
        for key, value in options.items():
            _check_option_type(key, value, spec.defaults.get(key))
    return spec


def _check_option_type(key: str, value: Any, default: Any) -> None:
    """`value` has the kind of `default`: a boolean, a number (no boolean or text; the estimator checks
    its range, and takes a 0-d tensor where it says so) or a string. Anything goes for a default of
    another kind (is_weights' None)."""
    if isinstance(default, bool):
        ok, want = isinstance(value, bool | np.bool_), "true or false"
    elif isinstance(default, numbers.Real):
        ok, want = not isinstance(value, bool | np.bool_ | str | bytes), "a number"
    elif isinstance(default, str):
        ok, want = isinstance(value, str), "a string"
    else:
        return
    if not ok:
        raise ValueError(f"{key} must be {want} (like {default!r}), got {value!r}")


def compute_advantages(
    estimator: str,
    *,
    rewards: Any,
    mask: Any,
    group_ids: Any,
    energy: Any = None,
    **options: Any,
) -> AdvantageResult:
    """Per-token advantages for a batch of grouped rollouts.

    estimator: a name in `otbrl.ESTIMATORS` ("otb", "grpo", "dr_grpo", "rloo", "opo", "sob", ...).
    rewards:   (B,) outcome rewards (placed on the last policy token) or (B, T) token rewards.
    mask:      (B, T) 0/1, 1 where the policy generated the token. A row with no policy token (all
               zero: e.g. a row that could not be scored, masked out by the caller) is a member of no
               group: it gets zero outputs and does not count in any group's size, mean, std or
               baseline, for every estimator. Its reward is still validated (NaN raises).
    group_ids: (B,) prompt identity: integer tensor, numpy array or sequence of hashables.
    energy:    (B, T) per-token energy w_t >= 0 (e.g. `otbrl.token_energy`); required by "otb" and "sob".
    options:   estimator keywords, e.g. otb's leave_one_out, align, zero_tail, is_weights, eps.
    Returns an `AdvantageResult` of (B, T) float32 tensors, zero where mask == 0.
    """
    spec = resolve(estimator, options)
    if spec.needs_energy and energy is None:
        raise ValueError(f"energy: estimator {estimator!r} needs per-token energy (see otbrl.token_energy)")
    batch = make_rollouts(rewards=rewards, mask=mask, group_ids=group_ids, energy=energy)
    advantages, baselines = spec.fn(batch, **options)
    if not spec.masked_output:
        off = ~batch.mask
        advantages, baselines = advantages.masked_fill(off, 0.0), baselines.masked_fill(off, 0.0)
    out = {"advantages": advantages.float(), "returns": batch.returns.float(), "baselines": baselines.float()}
    if batch.dtype == torch.float64:  # float32 batches are kept far from overflow (see make_rollouts)
        for name, value in out.items():
            _check_output(name, value, estimator)
    return AdvantageResult(**out)


def _check_output(name: str, value: torch.Tensor, estimator: str) -> None:
    """Finite inputs computed in float64 can still give values beyond float32's range (e.g. R - B with
    |R| ~ 2e38)."""
    if value.numel() == 0:
        return
    low, high = torch.aminmax(value)
    if not bool(torch.isfinite(low) & torch.isfinite(high)):
        bad = "NaN" if bool(value.isnan().any()) else "inf"
        raise ValueError(
            f"{name}: estimator {estimator!r} gave {bad} (finite inputs whose {name} do not fit float32); "
            "rescale the rewards"
        )


# ----------------------------------------------------------------------------------------------------
# Sequence-level helpers: one scalar per trajectory, compared within its group.


def _check_eps(eps: float) -> None:
    if not (isinstance(eps, (int, float)) and eps > 0):
        raise ValueError(f"eps: must be a number > 0, got {eps!r}")


def _group_mean(x: torch.Tensor, batch: Rollouts) -> torch.Tensor:
    """(B,) -> (B,) mean of x over the member rows of each row's group (0 for a group with none)."""
    total = group_sums(torch.where(batch.members, x, 0.0), batch.group, batch.n_groups)[batch.group]
    return total / batch.group_sizes.clamp_min(1)


def _weighted_group_baseline(
    r: torch.Tensor, weight: torch.Tensor, batch: Rollouts, eps: float
) -> torch.Tensor:
    """(B,) self-inclusive weighted baseline sum(weight R) / sum(weight) over the member rows of each
    group; the plain mean where the group's total weight is at most eps; 0 for groups of one member."""
    weight = torch.where(batch.members, weight, 0.0)
    num = group_sums(weight * r, batch.group, batch.n_groups)[batch.group]
    den = group_sums(weight, batch.group, batch.n_groups)[batch.group]
    base = torch.where(den > eps, num / den.clamp_min(eps), _group_mean(r, batch))
    return torch.where(batch.group_sizes > 1, base, 0.0)


def _per_token(
    advantage: torch.Tensor, baseline: torch.Tensor, batch: Rollouts
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) per-row values -> (B, T), zero where mask == 0 (a multiply: much faster than torch.where)."""
    keep = batch.mask_values
    return advantage.to(keep.dtype)[:, None] * keep, baseline.to(keep.dtype)[:, None] * keep


@register_estimator("grpo", masked_output=True)
def grpo(batch: Rollouts, *, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO (Shao et al. 2024, DeepSeekMath): A = (R - mean_group R) / (std_group R + eps).

    std is the unbiased (N - 1) group standard deviation over the N member rows (rows with a policy
    token, see `Rollouts`); a group of one member has mean 0 and std 1 (A = R).
    The reported baseline is the group mean; the advantage is (G - B) / (std + eps), not G - B.
    """
    _check_eps(eps)
    r = batch.outcome
    mean = _group_mean(r, batch)
    n = batch.group_sizes
    sq = group_sums(torch.where(batch.members, r - mean, 0.0) ** 2, batch.group, batch.n_groups)[batch.group]
    std = torch.where(n > 1, (sq / (n - 1).clamp_min(1)).sqrt(), 1.0)
    mean = torch.where(n > 1, mean, 0.0)
    return _per_token((r - mean) / (std + eps), mean, batch)


@register_estimator("dr_grpo", masked_output=True)
def dr_grpo(batch: Rollouts) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): A = R - mean_group R."""
    mean = torch.where(batch.group_sizes > 1, _group_mean(batch.outcome, batch), 0.0)
    return _per_token(batch.outcome - mean, mean, batch)


@register_estimator("rloo", masked_output=True)
def rloo(batch: Rollouts) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al. 2024; Kool et al. 2019): A = R - mean of the other N - 1 rewards in the group
    (N = member rows, see `Rollouts`)."""
    r, n = batch.outcome, batch.group_sizes
    others = group_sums(torch.where(batch.members, r, 0.0), batch.group, batch.n_groups)[batch.group] - r
    base = torch.where(n > 1, others / (n - 1).clamp_min(1), 0.0)
    return _per_token(r - base, base, batch)


@register_estimator("opo", masked_output=True)
def opo(batch: Rollouts, *, eps: float = 1e-8) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (Hao et al. 2025, arXiv 2505.23585): length-weighted baseline b = sum L_i R_i / sum L_i,
    L = number of policy tokens (the optimal baseline when ||S||^2 is proportional to length)."""
    _check_eps(eps)
    base = _weighted_group_baseline(batch.outcome, batch.lengths, batch, eps)
    return _per_token(batch.outcome - base, base, batch)


@register_estimator("sob", needs_energy=True, masked_output=True)
def sob(batch: Rollouts, *, eps: float = 1e-8) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence-level optimal baseline: b = sum W(tau_i) R_i / sum W(tau_i), W(tau) = sum_t w_t the
    trajectory's total proxy energy (Weaver & Tao 2001 with the Logit-Gradient Proxy for ||S||^2)."""
    _check_eps(eps)
    base = _weighted_group_baseline(batch.outcome, batch.energy.sum(dim=-1), batch, eps)
    return _per_token(batch.outcome - base, base, batch)


@register_estimator("reinforce_pp_baseline", masked_output=True)
def reinforce_pp_baseline(batch: Rollouts, *, eps: float = 1e-8) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (Hu et al. 2025): A = R - group mean, then whitened over all policy tokens of
    the batch: (A - mean) / sqrt(var + eps), var unbiased. A group of one has no group baseline but is
    still whitened with the batch."""
    _check_eps(eps)
    adv, base = dr_grpo(batch)
    keep = batch.mask_values
    count = keep.sum()
    if count == 0:
        return adv, base
    mean = adv.sum() / count
    centred = (adv - mean).mul_(keep)
    var = centred.square().sum() / (count - 1).clamp_min(1)
    return centred.div_(torch.sqrt(var + eps)), base


@register_estimator("otb", needs_energy=True, masked_output=True)
def otb(
    batch: Rollouts,
    *,
    leave_one_out: bool = False,
    align: str = "position",
    zero_tail: bool = True,
    is_weights: Any = None,
    eps: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimal Token Baseline (Li et al. 2026, arXiv 2602.07078).

    W_t = sum_{j<=t} w_j m_j (times rho_j^2 with importance weights), and within a group, over the
    trajectories active at aligned column t:  B_t = sum_i G_t W_t / sum_i W_t,  A_t = G_t - B_t.
    Rows with no policy token are no group members (see `Rollouts`); a group of one member gets no
    baseline (A = G).

    leave_one_out: B_t^(i) sums over the other trajectories only (unbiased for i.i.d. samples; also
        removes the need for zero_tail). Default False = the paper's self-inclusive form.
    align: "position" (absolute response position, single-turn) or "generated" (k-th policy token,
        for multi-turn masks with tool tokens). With "position" and masks with gaps, the trajectories
        compared at column t are those with a policy token at t, so a trajectory alone at an interior
        column (its peers all have a gap there) is treated like the tail of a uniquely longest
        response: no peer, no baseline, A = G (with zero_tail, and always with leave_one_out). verl's
        TIR estimator gives A = 0 there (the self-inclusive baseline of one trajectory is its own
        return, which cancels the token's signal); otbrl keeps one rule for every column, the one
        zero_tail exists for. zero_tail=False gives verl's A = 0.
    zero_tail: self-inclusive only: where a trajectory is the only active one of its group (the tail of a
        uniquely longest response), its baseline is 0 instead of itself. On left-aligned contiguous
        masks this is exactly the authors' handle_zero_tail rule.
    is_weights: (B, T) truncated importance weights rho_t >= 0; the energy becomes w_t rho_t^2.
    eps: where the summed energy is <= eps the weighted ratio is noise; use the plain mean of the active
        returns there instead.

    Computes in the batch's dtype (float32 or float64); leave_one_out always in float64, and a float32
    batch whose energy sums overflow (e.g. huge importance weights) is redone in float64.
    """
    _check_eps(eps)
    rho = None
    if is_weights is not None:
        keep, values, dtype = batch.mask, batch.mask_values, batch.dtype
        rho = check_token_values("is_weights", is_weights, keep, nonnegative=True, dtype=dtype, values=values)
    # leave_one_out: totals minus own shares cancel when one trajectory holds most of the energy.
    dtype = torch.float64 if leave_one_out else batch.dtype
    out = _otb(batch, rho, dtype, leave_one_out, align, zero_tail, eps)
    if out is None and dtype != torch.float64:
        out = _otb(batch, rho, torch.float64, leave_one_out, align, zero_tail, eps)
    if out is None:
        raise ValueError("energy: the energy sums overflow even in float64; rescale energy or is_weights")
    base = out.to(batch.dtype)
    return batch.returns - base, base


def _otb(
    batch: Rollouts,
    rho: torch.Tensor | None,
    dtype: torch.dtype,
    leave_one_out: bool,
    align: str,
    zero_tail: bool,
    eps: float,
) -> torch.Tensor | None:
    """OTB's (B, T) baselines in `dtype`, zero where mask == 0; None if the energy sums overflow.
    rho: (B, T) importance weights (energy w_t rho_t^2) or None."""
    keep = batch.mask
    ones = batch.mask_values.to(dtype)
    g, w = batch.returns.to(dtype), batch.energy.to(dtype)
    if rho is not None:
        w = w * rho.to(dtype).square()
    # W_t: the cumulative sum carries through mask == 0 tokens; keep it at policy tokens only.
    weighted = w.cumsum(dim=-1).mul_(ones)
    columns, width = aligned_columns(keep, align)

    def table(x: torch.Tensor) -> torch.Tensor:  # (B, T) -> (G, width): sums per group and column
        return group_sums(to_frame(x, columns, width), batch.group, batch.n_groups)

    def per_token(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """(G, width) -> (B, T): each policy token's cell, 0 elsewhere (written into `out` if given)."""
        if width == keep.shape[-1]:
            return rows_of(x, batch.group, batch.n_groups, ones, out=out)
        return from_frame(x.index_select(0, batch.group), columns).mul_(ones)

    den, count = table(weighted), table(ones)
    # Self-inclusive: W_t is not read again, so G_t W_t and then the baselines reuse its memory (on CPU
    # every fresh (B, T) tensor costs page faults comparable to an arithmetic pass).
    gw = g * weighted if leave_one_out else weighted.mul_(g)
    num = table(gw)
    if not bool(torch.isfinite(num).all() and torch.isfinite(den).all()):
        return None
    if leave_one_out:
        num, den, count = per_token(num) - gw, per_token(den) - weighted, per_token(count) - ones
    base = num / den.clamp_min(eps)
    weak = den <= eps  # too little energy to weigh by: use the plain mean of the returns instead
    if weak.logical_and_(count > 0.5).any():
        g_sum = per_token(table(g)) - g if leave_one_out else table(g)
        base = torch.where(weak, g_sum / count.clamp_min(1.0), base)
    if leave_one_out:
        return torch.where(count > 0.5, base, 0.0).mul_(ones)  # nobody else active: no baseline
    # Per-cell rules: a group of one member has no baseline; with zero_tail neither has a trajectory
    # that is alone at its column (count == 1 means the only active row there is the one reading it).
    no_baseline = (batch.group_counts == 1)[:, None]
    if zero_tail:
        no_baseline = no_baseline | (count < 1.5)
    return per_token(torch.where(no_baseline, 0.0, base), out=gw)

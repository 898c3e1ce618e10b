"""Policy-gradient losses over (B, T) per-token advantages: the last step of rollout -> energy ->
advantages -> loss. Pure functions, tensors in and a scalar out, with the aggregations the field uses
(token-mean, sequence-mean, constant) and optional PPO-style ratio clipping.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from otbrl.inputs import check_mask, check_token_values, compute_dtype

# name -> what it divides the summed per-token losses by; the names TRL and verl use for each are in
# `policy_gradient_loss`'s docstring.
AGGREGATIONS: dict[str, str] = {
    "token-mean": "the number of policy tokens in the batch",
    "sequence-mean": "each sequence's number of policy tokens, then the number of sequences",
    "constant": "the number of sequences times a constant normaliser (default T)",
}


@dataclass(frozen=True)
class PolicyLoss:
    """Output of `policy_gradient_loss_with_stats`: 0-dim tensors, in the compute dtype except the integer
    `num_tokens`; only `loss` carries gradient.

    loss:          the aggregated policy-gradient loss (minimise it).
    clip_fraction: fraction of policy tokens whose ratio the clipping cut off (0 without clipping).
    approx_kl:     mean over policy tokens of (r - 1) - log r, r = pi / pi_old (Schulman's k3 estimate
                   of KL(pi_old || pi); 0 on-policy).
    num_tokens:    number of policy tokens (mask == 1) in the batch.
    """

    loss: torch.Tensor
    clip_fraction: torch.Tensor
    approx_kl: torch.Tensor
    num_tokens: torch.Tensor


def _check_logprobs(name: str, value: Any, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) float log-probs, finite at policy tokens; returned as given (gradient intact)."""
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor of shape (B, T)")
    if value.shape != mask.shape:
        raise ValueError(f"{name}: shape {tuple(value.shape)} does not match mask {tuple(mask.shape)}")
    check_token_values(name, value.detach(), mask.to(value.device))  # raises on NaN/inf at policy tokens
    return value


def _check_clip(clip_eps: Any) -> tuple[float, float] | None:
    """None, a number eps (-> (eps, eps)) or a pair (low, high) of numbers in (0, inf)."""
    if clip_eps is None:
        return None
    pair = clip_eps if isinstance(clip_eps, (tuple, list)) else (clip_eps, clip_eps)
    ok = len(pair) == 2 and all(
        isinstance(e, (int, float)) and not isinstance(e, bool) and math.isfinite(e) and e > 0 for e in pair
    )
    if not ok or pair[0] >= 1:
        raise ValueError(
            f"clip_eps: expected None, a number in (0, 1) or a pair (low, high) with 0 < low < 1 and "
            f"high > 0, got {clip_eps!r}"
        )
    return float(pair[0]), float(pair[1])


def _check_aggregation(aggregation: Any, normaliser: Any, width: int) -> float | None:
    """The constant normaliser for "constant" (default `width`), None for the other aggregations."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation: unknown {aggregation!r}; known: {', '.join(AGGREGATIONS)}")
    if aggregation != "constant":
        if normaliser is not None:
            raise ValueError(f"normaliser: only used by aggregation='constant', not {aggregation!r}")
        return None
    if normaliser is None:
        return float(max(width, 1))
    if isinstance(normaliser, bool) or not (
        isinstance(normaliser, (int, float)) and math.isfinite(normaliser) and normaliser > 0
    ):
        raise ValueError(f"normaliser: must be a finite number > 0, got {normaliser!r}")
    return float(normaliser)


def _aggregate(
    token_loss: torch.Tensor, mask: torch.Tensor, aggregation: str, normaliser: float | None
) -> torch.Tensor:
    """(B, T) per-token losses, zero where mask is False, and (B, T) bool mask -> () scalar.

    Denominators are clamped to at least 1, so a batch with no policy token (B == 0 or an all-zero mask)
    gives 0, still attached to the graph (see `policy_gradient_loss`).
    """
    if aggregation == "token-mean":
        return token_loss.sum() / mask.sum().clamp_min(1)
    if aggregation == "sequence-mean":
        per_sequence = token_loss.sum(dim=-1) / mask.sum(dim=-1).clamp_min(1)
        return per_sequence.sum() / max(mask.shape[0], 1)
    return token_loss.sum() / (max(mask.shape[0], 1) * normaliser)


def policy_gradient_loss_with_stats(
    logprobs: torch.Tensor,
    advantages: Any,
    mask: Any,
    *,
    old_logprobs: torch.Tensor | None = None,
    clip_eps: float | tuple[float, float] | None = None,
    aggregation: str = "token-mean",
    normaliser: float | None = None,
) -> PolicyLoss:
    """`policy_gradient_loss` and a few detached diagnostics (see `PolicyLoss`)."""
    keep = check_mask(mask)
    logprobs = _check_logprobs("logprobs", logprobs, keep)
    keep = keep.to(logprobs.device)
    clip = _check_clip(clip_eps)
    constant = _check_aggregation(aggregation, normaliser, keep.shape[-1])
    dtype = compute_dtype(logprobs, advantages, old_logprobs)
    if isinstance(advantages, torch.Tensor):
        advantages = advantages.detach()  # a value head behind them must not receive the policy's gradient
    adv = check_token_values("advantages", advantages, keep, dtype=dtype)  # zero where mask is False
    # Zero the masked entries before any arithmetic, so padding (-inf or NaN log-probs) cannot leak NaN
    # into the gradient through exp() below.
    new = torch.where(keep, logprobs.to(dtype), 0.0)
    if old_logprobs is None:
        old = new.detach()  # on-policy: ratio 1, gradient of ratio = gradient of log pi
    else:
        old = torch.where(keep, _check_logprobs("old_logprobs", old_logprobs, keep).detach().to(dtype), 0.0)
    log_ratio = new - old
    ratio = torch.exp(log_ratio)
    token_loss = -ratio * adv
    clipped = torch.zeros_like(keep)
    if clip is not None:
        # PPO: the pessimistic (larger) of the unclipped and clipped losses; clip=(low, high) allows DAPO's
        # asymmetric "clip-higher".
        clipped_loss = -ratio.clamp(1.0 - clip[0], 1.0 + clip[1]) * adv
        clipped = (clipped_loss > token_loss) & keep
        # where, not maximum: at ties maximum would split the gradient between the two branches.
        token_loss = torch.where(clipped, clipped_loss, token_loss)
    token_loss = torch.where(keep, token_loss, 0.0)
    loss = _aggregate(token_loss, keep, aggregation, constant)
    count = keep.sum()
    with torch.no_grad():
        k3 = torch.where(keep, ratio - 1.0 - log_ratio, 0.0).sum() / count.clamp_min(1)
        frac = clipped.sum(dtype=dtype) / count.clamp_min(1)
    return PolicyLoss(loss=loss, clip_fraction=frac, approx_kl=k3, num_tokens=count)


def policy_gradient_loss(
    logprobs: torch.Tensor,
    advantages: Any,
    mask: Any,
    *,
    old_logprobs: torch.Tensor | None = None,
    clip_eps: float | tuple[float, float] | None = None,
    aggregation: str = "token-mean",
    normaliser: float | None = None,
) -> torch.Tensor:
    """Policy-gradient loss over per-token advantages; minimise it.

    logprobs:     (B, T) log pi(y_t) of the sampled tokens under the current policy, with gradient.
    advantages:   (B, T) per-token advantages A_t (e.g. `compute_advantages(...).advantages`); only read
                  where mask == 1 (and treated as constants: no gradient flows into them).
    mask:         (B, T) 0/1, 1 where the policy generated the token.
    old_logprobs: (B, T) log-probs under the policy that sampled the batch. None = on-policy (the current
                  log-probs, detached): ratio 1, so the gradient is the plain REINFORCE one.
    clip_eps:     PPO ratio clipping: eps, or (eps_low, eps_high) for the asymmetric form of DAPO. Per token
                  the loss is max(-r A, -clip(r, 1 - eps_low, 1 + eps_high) A), r = exp(logprobs - old).
                  None: no clipping, loss -r A.
    aggregation:  how the (B, T) token losses l_t become one number (L_i = policy tokens of row i):
                  "token-mean":    sum_i sum_t l_t / sum_i L_i (DAPO; TRL "dapo"/"bnpo", verl "token-mean")
                  "sequence-mean": (1/B) sum_i (1/L_i) sum_t l_t (original GRPO; TRL "grpo", verl
                                   "seq-mean-token-mean"); a row with no policy token adds 0 but counts
                                   in B, as in TRL
                  "constant":      sum_i sum_t l_t / (B * normaliser) (Dr. GRPO, normaliser = the maximum
                                   completion length; TRL "dr_grpo", verl "seq-mean-token-sum-norm")
    normaliser:   the constant of "constant" (default T, the padded width); not accepted otherwise.

    Returns a () tensor in float32 (float64 if any input is float64), whatever the input dtype.

    On-policy (old_logprobs None) the value is -(aggregated A), which says nothing by itself; the gradient
    is d loss / d logprobs[i, t] = -A[i, t] m[i, t] / n, with n the aggregation's denominator for that token.
    A batch with no policy token (B == 0, or mask all 0) gives 0 with a zero gradient rather than raising:
    a data-parallel rank or micro-batch that happens to hold only padding must still be able to call
    backward. token-mean normalises by this batch's tokens (TRL's "bnpo"); for the global-batch count of
    TRL's "dapo" under gradient accumulation, scale by local tokens / global tokens.
    """
    return policy_gradient_loss_with_stats(
        logprobs,
        advantages,
        mask,
        old_logprobs=old_logprobs,
        clip_eps=clip_eps,
        aggregation=aggregation,
        normaliser=normaliser,
    ).loss

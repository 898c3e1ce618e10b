"""Per-token statistics of a softmax over the vocabulary, and how partial statistics over disjoint
vocabulary slices (tiles, tensor-parallel shards) combine like an online softmax. Shared by the torch
path (`otbrl.fused`), the Triton kernel (`otbrl.fused_triton`) and the verl adapter.

-inf logits (masked vocabulary entries, padded shards, a whole slice of them) have probability 0 and
contribute nothing; a slice with no finite logit has max_logit -inf and s1 = s2 = a = 0. Only a row
with no finite logit at all, NaN/+inf logits, or a sampled token at -inf (log-prob -inf) raise.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


class TokenStats(NamedTuple):
    """Per-token statistics at the given temperature, each (...) float32 (float64 for float64 input)."""

    logprobs: torch.Tensor  # log softmax(z / T)[y]
    sum_pi_sq: torch.Tensor  # sum_v softmax(z / T)_v^2
    energy: torch.Tensor  # ||e_y - softmax(z / T)||^2, never negative
    entropy: torch.Tensor  # -sum_v pi_v log pi_v


class PartialStats(NamedTuple):
    """Statistics of each token over a slice of the vocabulary, relative to `max_logit` m:
    s1 = sum_{v != y} e^(z_v - m), s2 = sum_{v != y} e^(2(z_v - m)), a = sum_{v != y} e^(z_v - m)(z_v - m),
    label = z_y if the sampled token lies in the slice, else -inf. All (N,)."""

    max_logit: torch.Tensor
    s1: torch.Tensor
    s2: torch.Tensor
    a: torch.Tensor
    label: torch.Tensor


def combine_partial_stats(x: PartialStats, y: PartialStats) -> PartialStats:
    """Merge the statistics of two disjoint vocabulary slices (e.g. tensor-parallel shards)."""
    m = torch.maximum(x.max_logit, y.max_logit)

    def rescale(p: PartialStats) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # <= 0; -inf for a slice with no finite logit yet; 0 where both are -inf (not -inf - -inf = NaN)
        shift = torch.where(p.max_logit == m, 0.0, p.max_logit - m)
        c = torch.exp(shift)
        has = p.s1 > 0  # avoids -inf * 0 where a slice holds no mass
        a = torch.where(has, c * (p.a + torch.where(has, shift, 0.0) * p.s1), 0.0)
        return c * p.s1, c * c * p.s2, a

    s1x, s2x, ax = rescale(x)
    s1y, s2y, ay = rescale(y)
    return PartialStats(m, s1x + s1y, s2x + s2y, ax + ay, torch.maximum(x.label, y.label))


def finalize_partial_stats(p: PartialStats) -> TokenStats:
    """TokenStats from the statistics over the whole vocabulary. Raises as `check_finalized`."""
    rel = p.label - p.max_logit
    e_y = torch.exp(rel)
    s1 = p.s1 + e_y
    log_s1 = torch.log(s1)
    stats = TokenStats(
        logprobs=rel - log_s1,
        sum_pi_sq=(p.s2 + e_y * e_y) / (s1 * s1),
        energy=(p.s1 * p.s1 + p.s2) / (s1 * s1),
        entropy=log_s1 - (p.a + e_y * rel) / s1,
    )
    check_finalized(stats.logprobs, stats.sum_pi_sq)
    return stats


def check_finalized(logprobs: torch.Tensor, sum_pi_sq: torch.Tensor) -> None:
    """Raise ValueError unless every token's statistics are finite, naming the cause.

    sum pi^2 is non-finite exactly when a row's logits hold NaN or +inf or are all -inf (its max is not
    finite); with a finite max, sum pi^2 is finite and only the sampled token's logit being -inf (or the
    token lying in no slice that was combined) leaves its log-prob non-finite. Such a token has
    probability 0 and could not have been sampled from this policy; its log-prob -inf is of no use to a
    loss, so it is reported rather than returned (`otbrl.token_energy` alone gives its limit
    1 + sum pi^2).
    """
    if not torch.isfinite(sum_pi_sq).all():
        raise ValueError(
            "hidden: produce non-finite logits (NaN or +inf), or a row whose logits are all -inf"
        )
    if not torch.isfinite(logprobs).all():
        raise ValueError(
            "tokens: a sampled token has logit -inf (probability 0, so its log-prob is -inf), "
            "or lies in no vocabulary slice that was combined"
        )


def tile_partial_stats(z: torch.Tensor, local: torch.Tensor) -> PartialStats:
    """PartialStats of one logits tile z (N, Vt) (consumed), sampled tokens at columns `local` (N,),
    or outside the tile where local is out of [0, Vt)."""
    width = z.shape[1]
    inside = (local >= 0) & (local < width)
    col = local.clamp(0, width - 1)[:, None]
    m = z.amax(dim=1)
    label = torch.where(inside, z.gather(1, col).squeeze(1), -math.inf)
    # A row with no finite logit in the tile subtracts 0, so its logits stay -inf (e = 0), not NaN.
    z.sub_(torch.where(m == -math.inf, 0.0, m)[:, None])
    e = torch.exp(z)
    e.scatter_(1, col, torch.where(inside[:, None], 0.0, e.gather(1, col)))  # keep y out of the sums
    # -inf logits have e = 0; a finite stand-in turns their 0 * -inf in sum e * z into 0 (NaN stays NaN).
    z.clamp_(min=torch.finfo(z.dtype).min)
    # Row-wise dot products read the tile without writing a product tile.
    return PartialStats(
        m, e.sum(dim=1), torch.einsum("nv,nv->n", e, e), torch.einsum("nv,nv->n", e, z), label
    )


def empty_partial_stats(n: int, dtype: torch.dtype, device: torch.device) -> PartialStats:
    ninf = torch.full((n,), -math.inf, dtype=dtype, device=device)
    zero = torch.zeros(n, dtype=dtype, device=device)
    return PartialStats(ninf, zero, zero, zero, ninf.clone())

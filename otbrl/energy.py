"""The Logit-Gradient Proxy: per-token energy w_t = ||e_y - softmax(z_t / T)||^2 from forward logits.

Everything here is forward-only (no autograd graph), accumulates in at least float32 whatever the input
dtype, and walks the rows in chunks so a (16k, 152k) bf16 input never needs a full float32 copy.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from otbrl.inputs import check_mask, check_temperature, check_token_values, compute_dtype

# Elements of one float32 working tile (64 MiB). Peak extra memory is a small multiple of this,
# independent of the number of rows.
CHUNK_ELEMENTS = 1 << 24


def _check_logits(logits: torch.Tensor, temperature: Any) -> float:
    """Validate logits and the temperature; returns the temperature as a Python float."""
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise ValueError("logits: expected a floating-point tensor of shape (..., V)")
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits: expected shape (..., V) with V >= 1, got {tuple(logits.shape)}")
    return check_temperature(temperature)


def _tiles(logits: torch.Tensor, temperature: float) -> Iterator[tuple[slice, torch.Tensor]]:
    """Yield (rows, e) over chunks of rows of the flattened logits, e = exp(z/T - max z/T) in the
    compute dtype. One working buffer is reused for every chunk, so peak extra memory is one tile.

    -inf logits (masked vocabulary entries) are allowed and get probability 0; NaN, +inf or a row with
    no finite logit raise, after the pass, so a GPU is not synchronised once per chunk. The row max
    propagates all three, so one check on it suffices.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    rows, vocab = flat.shape
    step = max(1, min(rows, CHUNK_ELEMENTS // vocab))
    buffer = torch.empty(step, vocab, dtype=compute_dtype(logits), device=logits.device)
    bad = torch.zeros((), dtype=torch.bool, device=logits.device)
    for start in range(0, rows, step):
        chunk = flat[start : start + step]
        e = buffer[: chunk.shape[0]].copy_(chunk)
        if temperature != 1.0:
            e.div_(temperature)
        top = e.amax(dim=-1, keepdim=True)
        bad |= ~torch.isfinite(top).all()
        yield slice(start, start + chunk.shape[0]), e.sub_(top).exp_()
    if bad:
        raise ValueError("logits: contain NaN or +inf, or a row whose logits are all -inf")


@torch.no_grad()
def sum_pi_squared(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Sum over the vocabulary of squared probabilities, sum_v softmax(z / T)_v^2.

    logits: (..., V), any floating dtype. Returns (...) in float32 (float64 for float64 input).
    With e = exp(z/T - max z/T): sum pi^2 = sum e^2 / (sum e)^2, both sums of positive terms.
    """
    temperature = _check_logits(logits, temperature)
    out = torch.empty(logits.shape[:-1].numel(), dtype=compute_dtype(logits), device=logits.device)
    for rows, e in _tiles(logits, temperature):
        s1 = e.sum(dim=-1)
        out[rows] = e.square_().sum(dim=-1) / (s1 * s1)
    return out.reshape(logits.shape[:-1])


@torch.no_grad()
def token_energy(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Logit-space squared score norm of the sampled token, ||e_y - softmax(z / T)||^2, in [0, 2].

    logits: (..., V); tokens: (...) integer ids in [0, V). Returns (...) in float32 (float64 for float64
    logits). Written as ((sum_{v!=y} e_v)^2 + sum_{v!=y} e_v^2) / (sum_v e_v)^2 with e = exp(z/T - max):
    only sums of positive terms, so it is never negative and keeps its relative accuracy for confident
    tokens, where the textbook 1 - 2 pi_y + sum pi^2 cancels catastrophically.
    """
    temperature = _check_logits(logits, temperature)
    if not isinstance(tokens, torch.Tensor) or tokens.is_floating_point() or tokens.is_complex():
        raise ValueError("tokens: expected an integer tensor")
    if tokens.shape != logits.shape[:-1]:
        raise ValueError(
            f"tokens: shape {tuple(tokens.shape)} does not match logits {tuple(logits.shape)}[:-1]"
        )
    vocab = logits.shape[-1]
    if tokens.numel() and (tokens.min() < 0 or tokens.max() >= vocab):
        raise ValueError(f"tokens: ids must lie in [0, {vocab})")
    ids = tokens.reshape(-1, 1).to(device=logits.device, dtype=torch.long)
    out = torch.empty(ids.shape[0], dtype=compute_dtype(logits), device=logits.device)
    for rows, e in _tiles(logits, temperature):
        y = ids[rows]
        e_y = e.gather(-1, y).squeeze(-1)
        e.scatter_(-1, y, 0.0)  # e now holds only the tokens that were not sampled
        s1_other = e.sum(dim=-1)
        s2_other = e.square_().sum(dim=-1)
        s1 = s1_other + e_y
        out[rows] = (s1_other * s1_other + s2_other) / (s1 * s1)
    return out.reshape(tokens.shape)


def token_energy_from_logprobs(logprobs: torch.Tensor, sum_pi_sq: torch.Tensor) -> torch.Tensor:
    """Energy from per-token statistics only: (1 - pi_y)^2 + (sum pi^2 - pi_y^2), never negative.

    logprobs, sum_pi_sq: (...) with the same shape. Returns (...) in float32 (float64 if either is).
    (1 - pi_y)^2 is taken through expm1, exact for confident tokens. The rest, sum_{v != y} pi_v^2,
    cancels when pi_y dominates; since it lies in [0, (1 - pi_y)^2] (a sum of squares is at most the
    square of the sum) it is clamped to that range, which bounds the result's relative error where the
    plain textbook formula returns 0 or garbage. Prefer `token_energy` when the logits are at hand.
    """
    for name, t in (("logprobs", logprobs), ("sum_pi_sq", sum_pi_sq)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(f"{name}: expected a floating-point tensor")
        if not torch.isfinite(t).all():
            raise ValueError(f"{name}: contains NaN or inf")
    if logprobs.shape != sum_pi_sq.shape:
        raise ValueError(
            f"sum_pi_sq: shape {tuple(sum_pi_sq.shape)} does not match logprobs {tuple(logprobs.shape)}"
        )
    dtype = compute_dtype(logprobs, sum_pi_sq)
    lp = logprobs.to(dtype).clamp(max=0.0)
    first = torch.expm1(lp).square()
    rest = (sum_pi_sq.to(dtype) - torch.exp(2.0 * lp)).clamp(min=0.0)
    return first + torch.minimum(rest, first)


def realized_energy(energy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Realized energy W_t = sum_{j<=t} w_j m_j: cumulative over policy tokens, carried through the rest.

    energy, mask: (B, T). Values of `energy` where mask == 0 are never read. Returns (B, T) in float32
    (float64 for float64 energy).
    """
    keep = check_mask(mask)
    return check_token_values("energy", energy, keep, nonnegative=True).cumsum(dim=-1)

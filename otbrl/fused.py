"""Per-token log-prob, sum pi^2, energy and entropy straight from hidden states and the output head,
never holding more than one (rows x vocabulary) tile of logits.

Each token's statistics over a slice of the vocabulary form a `PartialStats`; two slices combine like
an online softmax. The torch path walks vocabulary tiles this way, the Triton kernel
(`otbrl.fused_triton`, CUDA) does the same in registers, and tensor-parallel vocabulary shards combine
with `combine_partial_stats`. The sampled token is kept out of the running sums so that the energy is a
sum of positive terms (never negative, accurate for confident tokens), as in `otbrl.token_energy`.

Hidden states and head may differ in dtype (e.g. bf16 hidden states with TRL's float32 head): both
paths form the logits in float32 (float64 if any input is float64), tile by tile. -inf logits (a masked
vocabulary entry, a padded shard) get probability 0 (see `otbrl.stats`).
"""

from __future__ import annotations

import math

import torch

from otbrl.inputs import check_temperature, compute_dtype
from otbrl.stats import (
    PartialStats,
    TokenStats,
    combine_partial_stats,
    empty_partial_stats,
    finalize_partial_stats,
    tile_partial_stats,
)

# Elements of one float32 logits tile on the torch path (16 MiB).
TILE_ELEMENTS = 1 << 22
VOCAB_TILE = 8192
BACKENDS = ("auto", "torch", "triton")


def _check(hidden, weight, tokens, temperature, bias) -> float:
    if not (isinstance(hidden, torch.Tensor) and hidden.is_floating_point() and hidden.dim() >= 1):
        raise ValueError("hidden: expected a floating-point tensor of shape (..., H)")
    if not (isinstance(weight, torch.Tensor) and weight.is_floating_point() and weight.dim() == 2):
        raise ValueError("weight: expected the output head's weight, a floating-point (V, H) tensor")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight: shape {tuple(weight.shape)} does not match hidden size {hidden.shape[-1]}")
    if weight.device != hidden.device:
        raise ValueError(f"weight: on {weight.device}, hidden on {hidden.device}")
    if not isinstance(tokens, torch.Tensor) or tokens.is_floating_point() or tokens.is_complex():
        raise ValueError("tokens: expected an integer tensor")
    if tokens.shape != hidden.shape[:-1]:
        raise ValueError(
            f"tokens: shape {tuple(tokens.shape)} does not match hidden {tuple(hidden.shape)}[:-1]"
        )
    if tokens.numel() and (tokens.min() < 0 or tokens.max() >= weight.shape[0]):
        raise ValueError(f"tokens: ids must lie in [0, {weight.shape[0]})")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (weight.shape[0],)):
        raise ValueError(f"bias: expected shape ({weight.shape[0]},)")
    return check_temperature(temperature)


@torch.no_grad()
def fused_partial_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    bias: torch.Tensor | None = None,
    vocab_start: int = 0,
    logprobs_only: bool = False,
) -> PartialStats:
    """Torch path: PartialStats of hidden (N, H) against weight (V, H), a vocabulary slice whose first
    id is `vocab_start` (0 unless the head is sharded). Logits are formed in the compute dtype (float32,
    or float64 if hidden, weight or bias is float64) one tile at a time, whatever mix of dtypes came in.
    `logprobs_only` skips s2 and a (for comparison)."""
    dtype = compute_dtype(hidden, weight, bias)
    n, vocab = hidden.shape[0], weight.shape[0]
    h = hidden.to(dtype)
    local_ids = tokens.to(device=hidden.device, dtype=torch.long) - vocab_start
    vt = min(vocab, VOCAB_TILE)
    rows = max(1, TILE_ELEMENTS // vt)
    stats = []
    for r0 in range(0, n, rows):
        stats.append(empty_partial_stats(min(rows, n - r0), dtype, hidden.device))
    for v0 in range(0, vocab, vt):
        w = weight[v0 : v0 + vt].to(dtype)  # upcast once per vocabulary tile
        b = None if bias is None else bias[v0 : v0 + vt].to(dtype)
        for i, r0 in enumerate(range(0, n, rows)):
            z = h[r0 : r0 + rows] @ w.T
            if b is not None:
                z += b
            if temperature != 1.0:
                z /= temperature
            local = local_ids[r0 : r0 + rows] - v0
            if logprobs_only:
                stats[i] = _logprob_tile_update(stats[i], z, local)
            else:
                stats[i] = combine_partial_stats(stats[i], tile_partial_stats(z, local))
    if not stats:
        return empty_partial_stats(0, dtype, hidden.device)
    return PartialStats(*(torch.cat(parts) for parts in zip(*stats, strict=True)))


def _logprob_tile_update(p: PartialStats, z: torch.Tensor, local: torch.Tensor) -> PartialStats:
    """The log-prob-only online update (running max, sum of exp, label logit): the baseline that the
    full statistics are benchmarked against."""
    width = z.shape[1]
    inside = (local >= 0) & (local < width)
    col = local.clamp(0, width - 1)[:, None]
    label = torch.maximum(p.label, torch.where(inside, z.gather(1, col).squeeze(1), -math.inf))
    m = torch.maximum(p.max_logit, z.amax(dim=1))
    ref = torch.where(m == -math.inf, 0.0, m)  # no finite logit yet: -inf - -inf would be NaN
    s1 = p.s1 * torch.exp(p.max_logit - ref) + torch.exp(z.sub_(ref[:, None])).sum(dim=1)
    return PartialStats(m, s1, p.s2, p.a, label)


def _triton_usable(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    if not hidden.is_cuda or torch.float64 in (hidden.dtype, weight.dtype):  # float64: torch path
        return False
    try:  # triton is optional (CUDA only); the core works with torch alone
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def fused_token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    bias: torch.Tensor | None = None,
    backend: str = "auto",
) -> TokenStats:
    """Per-token logprobs, sum pi^2, energy and entropy of softmax((hidden @ weight.T + bias) / T).

    hidden: (..., H) final hidden states at the positions that predict `tokens` (...); weight: (V, H)
    output head; bias: (V,) or None. Any floating dtypes, mixed or not (bf16 hidden with a float32 head
    gives the logits of hidden.float() @ weight.T); accumulation in float32 (float64 if any input is
    float64). -inf logits (masked entries) get probability 0. Never holds more than one tile of logits.
    backend: "auto" (Triton on CUDA when installed, else torch), "torch" or "triton". Returns a
    `TokenStats` of (...) tensors; no autograd graph. Raises ValueError for NaN/+inf logits, a row
    whose logits are all -inf, or a sampled token whose logit is -inf (probability 0).
    """
    temperature = _check(hidden, weight, tokens, temperature, bias)
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    shape = tokens.shape
    h, y = hidden.reshape(-1, hidden.shape[-1]), tokens.reshape(-1)
    if backend == "triton" or (backend == "auto" and _triton_usable(hidden, weight)):
        from otbrl.fused_triton import triton_token_stats  # imports triton: only when it is used

        stats = triton_token_stats(h, weight, y, temperature, bias)
    else:
        stats = finalize_partial_stats(fused_partial_stats(h, weight, y, temperature, bias))
    return TokenStats(*(s.reshape(shape) for s in stats))

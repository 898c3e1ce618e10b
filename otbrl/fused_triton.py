"""Triton kernel for `otbrl.fused.fused_token_stats`: one program per block of tokens walks the
vocabulary in tiles, forms each logits tile with tl.dot (float32 accumulation), and keeps the online
statistics of `otbrl.fused.PartialStats` in registers. Logits never reach global memory.

Runs on CUDA; on the CPU only under Triton's interpreter (TRITON_INTERPRET=1 set before import), which
is how the tests cover it.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from otbrl.stats import TokenStats


@triton.jit
def _token_stats_kernel(
    hidden_ptr, weight_ptr, bias_ptr, tokens_ptr,
    logprob_ptr, spsq_ptr, energy_ptr, entropy_ptr,
    n_tokens, vocab, hidden_size, inv_temperature,
    stride_h, stride_w,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_tokens
    label_id = tl.load(tokens_ptr + rows, mask=row_ok, other=0)
    ninf = float("-inf")
    m = tl.full((BLOCK_N,), ninf, tl.float32)
    label = tl.full((BLOCK_N,), ninf, tl.float32)
    s1 = tl.zeros((BLOCK_N,), tl.float32)
    s2 = tl.zeros((BLOCK_N,), tl.float32)
    a = tl.zeros((BLOCK_N,), tl.float32)
    for v0 in range(0, vocab, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < vocab
        z = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
        for k0 in range(0, hidden_size, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < hidden_size
            h = tl.load(hidden_ptr + rows[:, None] * stride_h + ks[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
            w = tl.load(weight_ptr + cols[:, None] * stride_w + ks[None, :],
                        mask=col_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
            if UPCAST:
                h, w = h.to(tl.float32), w.to(tl.float32)
            if IEEE:
                z += tl.dot(h, tl.trans(w), input_precision="ieee")
            else:
                z += tl.dot(h, tl.trans(w))
        if HAS_BIAS:
            z += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        z = tl.where(col_ok[None, :], z * inv_temperature, ninf)
        is_label = cols[None, :] == label_id[:, None]
        label = tl.maximum(label, tl.max(tl.where(is_label, z, ninf), axis=1))
        m_new = tl.maximum(m, tl.max(z, axis=1))
        shift = m - m_new  # -inf before the first tile, where s1 and a are still 0
        c = tl.exp(shift)
        a = c * (a + tl.where(s1 > 0, shift, 0.0) * s1)
        s1 = c * s1
        s2 = c * c * s2
        keep = col_ok[None, :] & (is_label == 0)
        zs = tl.where(keep, z - m_new[:, None], 0.0)  # no -inf left to multiply by 0
        e = tl.where(keep, tl.exp(zs), 0.0)
        s1 += tl.sum(e, axis=1)
        s2 += tl.sum(e * e, axis=1)
        a += tl.sum(e * zs, axis=1)
        m = m_new
    rel = label - m
    e_y = tl.exp(rel)
    total = s1 + e_y
    log_total = tl.log(total)
    tl.store(logprob_ptr + rows, rel - log_total, mask=row_ok)
    tl.store(spsq_ptr + rows, (s2 + e_y * e_y) / (total * total), mask=row_ok)
    tl.store(energy_ptr + rows, (s1 * s1 + s2) / (total * total), mask=row_ok)
    tl.store(entropy_ptr + rows, log_total - (a + e_y * rel) / total, mask=row_ok)


def triton_token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    bias: torch.Tensor | None = None,
    block_n: int = 32,
    block_v: int = 64,
    block_k: int = 32,
) -> TokenStats:
    """hidden (N, H), weight (V, H), tokens (N,) -> TokenStats of (N,) float32 tensors.

    float32 inputs use IEEE float32 products (no TF32) so the result matches the torch path to 1e-5.
    Under the interpreter, tiles are upcast to float32 before tl.dot: its bf16/fp16 dot is wrong
    (numpy has no bfloat16); on a GPU they go to tl.dot as they are, accumulating in float32.
    """
    upcast = os.environ.get("TRITON_INTERPRET") == "1" and hidden.dtype != torch.float32
    hidden, weight = hidden.contiguous(), weight.contiguous()
    n, hidden_size = hidden.shape
    outs = [torch.empty(n, dtype=torch.float32, device=hidden.device) for _ in range(4)]
    bias_arg = bias.contiguous() if bias is not None else hidden  # never read without HAS_BIAS
    grid = (triton.cdiv(n, block_n),)
    _token_stats_kernel[grid](
        hidden, weight, bias_arg, tokens.contiguous(), *outs,
        n, weight.shape[0], hidden_size, 1.0 / temperature,
        hidden.stride(0), weight.stride(0),
        HAS_BIAS=bias is not None, IEEE=upcast or hidden.dtype == torch.float32, UPCAST=upcast,
        BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_K=block_k,
    )  # fmt: skip
    if not all(torch.isfinite(o).all() for o in outs[:2]):
        raise ValueError("hidden: produce non-finite logits")
    return TokenStats(*outs)

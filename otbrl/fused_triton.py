"""Triton kernel for `otbrl.fused.fused_token_stats`: one program per block of tokens walks the
vocabulary in tiles, forms each logits tile with tl.dot (float32 accumulation), and keeps the online
statistics of `otbrl.fused.PartialStats` in registers. Logits never reach global memory.

Runs on CUDA; on the CPU only under Triton's interpreter (TRITON_INTERPRET=1 set before import), which
is how the tests cover it. The dtype the tiles enter tl.dot in is chosen by `dot_dtype`; -inf logits
(masked vocabulary entries, padding) get probability 0 as on the torch path.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from otbrl.stats import TokenStats, check_finalized

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def dot_dtype(hidden: torch.dtype, weight: torch.dtype, interpreting: bool = False) -> torch.dtype:
    """The dtype both (rows x hidden) and (vocabulary x hidden) tiles are cast to before tl.dot, which
    accumulates in float32 either way and rejects operands of different dtypes.

    - Same bf16 or fp16 dtype: kept (tensor cores).
    - Anything else, i.e. float32 or mixed dtypes such as bf16 hidden states with a float32 head (TRL's
      cast_lm_head_to_fp32): float32 with IEEE products (no TF32), the logits of
      hidden.float() @ weight.float().T that the torch path forms. float64 also runs in float32 here
      (`otbrl.fused` keeps float64 on the torch path unless the Triton backend is forced).
    - Under Triton's CPU interpreter, bf16 also goes to float32: numpy has no bfloat16 and the
      interpreter's bf16 dot is wrong. This is the only interpreter-specific rule.
    """
    if hidden == weight and hidden in (torch.bfloat16, torch.float16):
        return torch.float32 if interpreting and hidden == torch.bfloat16 else hidden
    return torch.float32


@triton.jit
def _token_stats_kernel(
    hidden_ptr,
    weight_ptr,
    bias_ptr,
    tokens_ptr,
    logprob_ptr,
    spsq_ptr,
    energy_ptr,
    entropy_ptr,
    n_tokens,
    vocab,
    hidden_size,
    inv_temperature,
    stride_h,
    stride_w,
    HAS_BIAS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
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
            h = tl.load(
                hidden_ptr + rows[:, None] * stride_h + ks[None, :],
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            w = tl.load(
                weight_ptr + cols[:, None] * stride_w + ks[None, :],
                mask=col_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            # tl.dot needs equal operand dtypes; .to is a no-op where a tile already has DOT_DTYPE
            h, w = h.to(DOT_DTYPE), w.to(DOT_DTYPE)
            if DOT_DTYPE == tl.float32:
                z += tl.dot(h, tl.trans(w), input_precision="ieee")
            else:
                z += tl.dot(h, tl.trans(w))
        if HAS_BIAS:
            z += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        z = tl.where(col_ok[None, :], z * inv_temperature, ninf)
        is_label = cols[None, :] == label_id[:, None]
        label = tl.maximum(label, tl.max(tl.where(is_label, z, ninf), axis=1))
        m_new = tl.maximum(m, tl.max(z, axis=1))
        # -inf before the first finite logit, where s1, s2 and a are still 0; while every logit seen is
        # -inf, m_new is too and m - m_new would be NaN, so nothing is rescaled
        ref = tl.where(m_new == ninf, 0.0, m_new)  # m_new, except 0 where it is -inf: never NaN below
        shift = tl.where(m_new == ninf, 0.0, m - ref)
        c = tl.exp(shift)
        a = c * (a + tl.where(s1 > 0, shift, 0.0) * s1)
        s1 = c * s1
        s2 = c * c * s2
        # -inf logits (padding columns, masked entries) have probability 0 and leave the sums alone; they
        # are kept out so that e * zs never meets 0 * -inf. NaN stays in, to be reported.
        keep = (z != ninf) & (is_label == 0)
        zs = tl.where(keep, z - ref[:, None], 0.0)
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
    e_y_rel = e_y * tl.where(e_y > 0, rel, 0.0)  # not 0 * -inf, in rows that raise or are padding
    tl.store(entropy_ptr + rows, log_total - (a + e_y_rel) / total, mask=row_ok)


def triton_token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    bias: torch.Tensor | None = None,
    block_n: int = 64,
    block_v: int = 128,
    block_k: int = 64,
) -> TokenStats:
    """hidden (N, H), weight (V, H), tokens (N,) -> TokenStats of (N,) float32 tensors.

    hidden and weight may differ in dtype (e.g. bf16 hidden states with a float32 head): each tile is
    cast in registers to `dot_dtype(...)` before tl.dot, so no copy of the head is made. Raises
    ValueError for NaN/+inf logits, a row whose logits are all -inf, or a sampled token at -inf.
    """
    dot = dot_dtype(hidden.dtype, weight.dtype, interpreting=os.environ.get("TRITON_INTERPRET") == "1")
    hidden, weight = hidden.contiguous(), weight.contiguous()
    n, hidden_size = hidden.shape
    outs = [torch.empty(n, dtype=torch.float32, device=hidden.device) for _ in range(4)]
    bias_arg = bias.contiguous() if bias is not None else hidden  # never read without HAS_BIAS
    grid = (triton.cdiv(n, block_n),)
    _token_stats_kernel[grid](
        hidden,
        weight,
        bias_arg,
        tokens.contiguous(),
        *outs,
        n,
        weight.shape[0],
        hidden_size,
        1.0 / temperature,
        hidden.stride(0),
        weight.stride(0),
        HAS_BIAS=bias is not None,
        DOT_DTYPE=_TL_DTYPES[dot],
        BLOCK_N=block_n,
        BLOCK_V=block_v,
        BLOCK_K=block_k,
    )
    check_finalized(*outs[:2])
    return TokenStats(*outs)

"""otbrl.fused: per-token stats from hidden states against a float64 reference written here, tiling,
vocabulary shards, numerics, bad input, and the Triton kernel through Triton's CPU interpreter."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import otbrl
from otbrl import fused
from otbrl.fused import fused_partial_stats, fused_token_stats
from otbrl.stats import combine_partial_stats, finalize_partial_stats


def reference(hidden, weight, tokens, temperature=1.0, bias=None) -> list[torch.Tensor]:
    """float64 logprob, sum pi^2, energy, entropy from the materialised logits."""
    z = hidden.double() @ weight.double().T
    if bias is not None:
        z = z + bias.double()
    z = z / temperature
    logp = torch.log_softmax(z, -1)
    p = logp.exp()
    y = tokens[..., None]
    others = p.scatter(-1, y, 0.0)  # 1 - p_y as the sum of the others: no cancellation
    return [
        logp.gather(-1, y).squeeze(-1),
        p.square().sum(-1),
        others.sum(-1).square() + others.square().sum(-1),
        -(p * logp).sum(-1),
    ]


def case(n=29, h=24, v=150, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * scale).to(dtype)
    weight = (torch.randn(v, h, generator=g) * 0.4).to(dtype)
    bias = torch.randn(v, generator=g).to(dtype)
    tokens = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, tokens, bias


def assert_rel(got, ref, tol):
    for name, a, b in zip(otbrl.TokenStats._fields, got, ref, strict=True):
        err = ((a.double() - b).abs() / b.abs().clamp_min(1e-300)).max().item()
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol}"


@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float64, 1e-10), (torch.float32, 1e-5), (torch.bfloat16, 1e-3)]
)
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("with_bias", [False, True])
def test_torch_path_matches_float64_reference(dtype, tol, temperature, with_bias):
    hidden, weight, tokens, bias = case(dtype=dtype)
    bias = bias if with_bias else None
    got = fused_token_stats(hidden, weight, tokens, temperature, bias, backend="torch")
    assert got.logprobs.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_rel(got, reference(hidden, weight, tokens, temperature, bias), tol)


def test_many_tiles_and_row_chunks(monkeypatch):
    hidden, weight, tokens, bias = case(n=41, v=157)
    whole = fused_token_stats(hidden, weight, tokens, 0.8, bias, backend="torch")
    monkeypatch.setattr(fused, "VOCAB_TILE", 16)  # 10 vocabulary tiles, the last one partial
    monkeypatch.setattr(fused, "TILE_ELEMENTS", 16 * 6)  # chunks of 6 rows, the last one partial
    tiled = fused_token_stats(hidden, weight, tokens, 0.8, bias, backend="torch")
    for a, b in zip(whole, tiled, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert_rel(tiled, reference(hidden, weight, tokens, 0.8, bias), 1e-5)


def test_leading_dimensions_and_agreement_with_logits_api():
    hidden, weight, tokens, _ = case(n=24)
    hidden, tokens = hidden.view(2, 3, 4, -1), tokens.view(2, 3, 4)
    got = fused_token_stats(hidden, weight, tokens)
    assert got.energy.shape == (2, 3, 4)
    logits = hidden @ weight.T
    torch.testing.assert_close(got.energy, otbrl.token_energy(logits, tokens), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got.sum_pi_sq, otbrl.sum_pi_squared(logits), rtol=1e-5, atol=1e-7)


def test_confident_tokens_keep_relative_accuracy():
    # Hidden states aligned with their token's head row: logit gaps of 20-60, energies down to ~1e-26.
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(2000, 32, generator=g)
    tokens = torch.randint(0, 2000, (64,), generator=g)
    gap = torch.linspace(0.5, 2.0, 64)[:, None]
    hidden = weight[tokens] * gap
    got = fused_token_stats(hidden, weight, tokens)
    ref = reference(hidden, weight, tokens)
    assert (got.energy >= 0).all() and ref[2].min() < 1e-20
    rel = ((got.energy.double() - ref[2]) / ref[2]).abs().max().item()
    assert rel < 1e-4
    textbook = 1 - 2 * got.logprobs.exp() + got.sum_pi_sq  # what the cancelling formula would give
    assert ((textbook.double() - ref[2]).abs() / ref[2]).max() > 1.0


def test_vocabulary_shards_combine_like_tensor_parallelism():
    hidden, weight, tokens, bias = case(v=151)
    bounds = [0, 40, 41, 151]  # uneven shards, one of a single token
    parts = [
        fused_partial_stats(hidden, weight[a:b], tokens, 0.9, bias[a:b], vocab_start=a)
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    forward = finalize_partial_stats(
        combine_partial_stats(combine_partial_stats(parts[0], parts[1]), parts[2])
    )
    backward = finalize_partial_stats(
        combine_partial_stats(parts[2], combine_partial_stats(parts[1], parts[0]))
    )
    ref = reference(hidden, weight, tokens, 0.9, bias)
    assert_rel(forward, ref, 1e-5)
    assert_rel(backward, ref, 1e-5)


def test_logprob_only_pass_agrees():
    hidden, weight, tokens, _ = case()
    p = fused_partial_stats(hidden, weight, tokens, logprobs_only=True)
    logprobs = p.label - p.max_logit - torch.log(p.s1)  # here s1 includes the sampled token
    torch.testing.assert_close(logprobs.double(), reference(hidden, weight, tokens)[0], rtol=1e-5, atol=1e-6)


def test_empty_input():
    hidden, weight, _, _ = case()
    got = fused_token_stats(hidden[:0], weight, torch.zeros(0, dtype=torch.long))
    assert got.energy.shape == (0,)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"hidden": torch.ones(3, 5)}, "weight: shape"),
        ({"weight": torch.ones(5)}, "weight: expected"),
        ({"tokens": torch.zeros(4, dtype=torch.long)}, "tokens: shape"),
        ({"tokens": torch.full((3,), 7)}, r"tokens: ids must lie in \[0, 7\)"),
        ({"tokens": torch.zeros(3)}, "tokens: expected an integer"),
        ({"temperature": 0.0}, "temperature"),
        ({"bias": torch.ones(6)}, "bias"),
        ({"backend": "cuda"}, "backend"),
        ({"hidden": torch.full((3, 4), math.nan)}, "hidden: produce non-finite"),
    ],
)
def test_bad_input(change, match):
    kw = dict(hidden=torch.ones(3, 4), weight=torch.ones(7, 4), tokens=torch.zeros(3, dtype=torch.long))
    kw.update(change)
    with pytest.raises(ValueError, match=match):
        fused_token_stats(**kw)


TRITON_SCRIPT = textwrap.dedent(
    """
    import json, torch
    from otbrl.fused import fused_token_stats
    from tests.test_fused import case, reference
    out = {}
    # sizes that are not multiples of the blocks (32 rows, 64 vocabulary, 32 hidden)
    for dtype in (torch.float32, torch.bfloat16):
        for temperature, with_bias in ((1.0, False), (0.7, True)):
            hidden, weight, tokens, bias = case(n=45, h=40, v=150, dtype=dtype)
            bias = bias if with_bias else None
            got = fused_token_stats(hidden, weight, tokens, temperature, bias, backend="triton")
            ref = reference(hidden, weight, tokens, temperature, bias)
            errs = [((a.double() - b).abs() / b.abs()).max().item() for a, b in zip(got, ref)]
            out[f"{dtype}-{temperature}-{with_bias}"] = max(errs)
            out["min_energy"] = min(out.get("min_energy", 1.0), got.energy.min().item())
    print(json.dumps(out))
    """
)


def test_triton_kernel_under_the_interpreter():
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=root)
    run = subprocess.run(
        [sys.executable, "-c", TRITON_SCRIPT], env=env, cwd=root, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    errors = json.loads(run.stdout.strip().splitlines()[-1])
    assert errors.pop("min_energy") >= 0
    for key, err in errors.items():
        tol = 1e-5 if "float32" in key else 1e-3
        assert err <= tol, (key, err)

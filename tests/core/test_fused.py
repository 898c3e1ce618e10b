"""otbrl.fused: per-token stats from hidden states against a float64 reference written here, tiling,
vocabulary shards, numerics, bad input, and the Triton kernel through Triton's CPU interpreter."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import otbrl
from otbrl import fused
from otbrl.fused import fused_partial_stats, fused_token_stats
from otbrl.stats import combine_partial_stats, empty_partial_stats, finalize_partial_stats


def reference(hidden, weight, tokens, temperature=1.0, bias=None) -> list[torch.Tensor]:
    """float64 logprob, sum pi^2, energy, entropy from the materialised logits; -inf logits have
    probability 0 and add nothing to the entropy (p log p -> 0)."""
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
        -torch.where(p > 0, p * logp, 0.0).sum(-1),
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


@pytest.mark.parametrize(
    ("hidden_dtype", "weight_dtype"),
    [
        (torch.bfloat16, torch.float32),  # TRL's cast_lm_head_to_fp32
        (torch.float32, torch.bfloat16),
        (torch.float16, torch.float32),
        (torch.bfloat16, torch.float16),
    ],
)
def test_torch_path_mixed_dtypes(hidden_dtype, weight_dtype):
    hidden, weight, tokens, bias = case()
    hidden, weight = hidden.to(hidden_dtype), weight.to(weight_dtype)
    got = fused_token_stats(hidden, weight, tokens, 0.7, bias, backend="torch")
    assert got.logprobs.dtype == torch.float32
    assert_rel(got, reference(hidden, weight, tokens, 0.7, bias), 1e-5)


def test_float64_head_with_float32_hidden_computes_in_float64():
    # compute_dtype's one rule: float64 if any input is float64 (the head here)
    hidden, weight, tokens, bias = case()
    weight = weight.double() + 1e-9  # a head that float32 cannot represent
    got = fused_token_stats(hidden, weight, tokens, 0.7, bias)
    assert got.logprobs.dtype == torch.float64
    assert_rel(got, reference(hidden, weight, tokens, 0.7, bias), 1e-10)


def masked_case(v=150, masked=(), n=29, seed=0):
    """case() with bias -inf at the `masked` ids and every token moved off them."""
    hidden, weight, tokens, bias = case(n=n, v=v, seed=seed)
    masked = torch.as_tensor(list(masked), dtype=torch.long)
    bias[masked] = -math.inf
    allowed = torch.ones(v, dtype=torch.bool)
    allowed[masked] = False
    ok = allowed.nonzero().squeeze(1)
    tokens = ok[tokens % ok.numel()]
    return hidden, weight, tokens, bias


def assert_finite_and_close(got, ref, tol):
    for name, t in zip(otbrl.TokenStats._fields, got, strict=True):
        assert torch.isfinite(t).all(), f"{name}: not finite"
    assert_rel(got, ref, tol)


def test_neg_inf_bias_entry_gives_finite_statistics():
    # the reported case: one masked vocabulary entry made every entropy NaN
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(3, 4, generator=g), torch.randn(5, 4, generator=g)
    tokens, bias = torch.tensor([1, 2, 3]), torch.tensor([-math.inf, 0, 0, 0, 0])
    got = fused_token_stats(hidden, weight, tokens, bias=bias, backend="torch")
    assert_finite_and_close(got, reference(hidden, weight, tokens, bias=bias), 1e-5)


@pytest.mark.parametrize(
    "masked",
    [
        pytest.param(range(0, 16), id="first-tile"),
        pytest.param(range(32, 48), id="middle-tile"),
        pytest.param(range(144, 150), id="last-partial-tile"),
        pytest.param([*range(0, 40), 77, 99, 100], id="two-tiles-and-scattered"),
    ],
)
def test_whole_neg_inf_vocabulary_tile(monkeypatch, masked):
    monkeypatch.setattr(fused, "VOCAB_TILE", 16)
    hidden, weight, tokens, bias = masked_case(masked=masked)
    got = fused_token_stats(hidden, weight, tokens, 0.8, bias, backend="torch")
    assert_finite_and_close(got, reference(hidden, weight, tokens, 0.8, bias), 1e-5)
    p = fused_partial_stats(hidden, weight, tokens, 0.8, bias, logprobs_only=True)
    logprobs = p.label - p.max_logit - torch.log(p.s1)
    torch.testing.assert_close(
        logprobs.double(), reference(hidden, weight, tokens, 0.8, bias)[0], rtol=1e-5, atol=1e-6
    )


def test_all_neg_inf_shard_combines_with_normal_ones():
    # a padded tensor-parallel shard: every logit -inf; two of them, combined in either order
    hidden, weight, tokens, bias = masked_case(v=151, masked=[*range(40, 60), *range(130, 151)])
    bounds = [0, 40, 60, 130, 151]
    parts = [
        fused_partial_stats(hidden, weight[a:b], tokens, 0.9, bias[a:b], vocab_start=a)
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    assert (parts[1].max_logit == -math.inf).all() and (parts[1].s1 == 0).all()
    ref = reference(hidden, weight, tokens, 0.9, bias)
    pairs = combine_partial_stats(
        combine_partial_stats(parts[1], parts[3]),  # both all -inf: still "nothing seen"
        combine_partial_stats(parts[2], parts[0]),
    )
    chain = parts[3]
    for part in parts[:3]:
        chain = combine_partial_stats(chain, part)
    assert_finite_and_close(finalize_partial_stats(pairs), ref, 1e-5)
    assert_finite_and_close(finalize_partial_stats(chain), ref, 1e-5)


def test_combine_with_an_empty_slice_is_the_identity():
    hidden, weight, tokens, bias = case()
    full = fused_partial_stats(hidden, weight, tokens, 1.0, bias)
    empty = empty_partial_stats(hidden.shape[0], torch.float32, hidden.device)
    both_empty = combine_partial_stats(empty, empty)
    for got in (combine_partial_stats(both_empty, full), combine_partial_stats(full, both_empty)):
        for a, b in zip(got, full, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_sampled_token_at_neg_inf_raises():
    hidden, weight, tokens, bias = masked_case(masked=[3])
    tokens[5] = 3  # probability 0: its log-prob is -inf
    with pytest.raises(ValueError, match="tokens: a sampled token has logit -inf"):
        fused_token_stats(hidden, weight, tokens, bias=bias, backend="torch")


def test_row_with_every_logit_neg_inf_raises():
    hidden, weight, tokens, _ = case()
    with pytest.raises(ValueError, match="hidden: .*all -inf"):
        fused_token_stats(hidden, weight, tokens, bias=torch.full((150,), -math.inf))


@settings(max_examples=40, deadline=None)
@given(
    vocab=st.integers(2, 40),
    data=st.data(),
    seed=st.integers(0, 2**16),
)
def test_masking_an_entry_equals_dropping_it(vocab, data, seed):
    # Law: a -inf logit is the same as that entry not being in the vocabulary at all.
    keep = torch.tensor(data.draw(st.lists(st.booleans(), min_size=vocab, max_size=vocab)))
    tiles = -(-vocab // 8)  # whole tiles of 8 masked on their own, not only by chance
    whole = torch.tensor(data.draw(st.lists(st.booleans(), min_size=tiles, max_size=tiles)))
    keep &= ~whole.repeat_interleave(8)[:vocab]
    if not keep.any():
        keep[seed % vocab] = True
    hidden, weight, _, bias = case(n=5, h=6, v=vocab, seed=seed)
    kept = keep.nonzero().squeeze(1)
    local = torch.randint(0, kept.numel(), (5,), generator=torch.Generator().manual_seed(seed))
    masked_bias = bias.masked_fill(~keep, -math.inf)
    with mock.patch.object(fused, "VOCAB_TILE", 8):
        masked = fused_token_stats(hidden, weight, kept[local], 1.3, masked_bias, backend="torch")
    dropped = fused_token_stats(hidden, weight[kept], local, 1.3, bias[kept], backend="torch")
    for a, b in zip(masked, dropped, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


TRITON_SCRIPT = textwrap.dedent(
    """
    import json, torch
    from otbrl.fused import fused_token_stats
    from tests.core.test_fused import case, reference
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


def run_interpreted(script: str) -> dict:
    """Run `script` with the Triton kernel built for the CPU interpreter; its last stdout line is JSON.
    Triton 3.6's interpreter cannot loop over a kernel's integer argument (seen on a GPU machine, where
    the compiled kernel passed test_fused_cuda.py): the interpreter tests need 3.9, the version tested."""
    pytest.importorskip("triton", minversion="3.9")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=root)
    run = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_triton_kernel_under_the_interpreter():
    errors = run_interpreted(TRITON_SCRIPT)
    assert errors.pop("min_energy") >= 0
    for key, err in errors.items():
        tol = 1e-5 if "float32" in key else 1e-3
        assert err <= tol, (key, err)


# The kernel is built as an interpreted function when otbrl.fused_triton is imported. The wrapper is
# then shown an environment without TRITON_INTERPRET (Triton itself still sees it), so it prepares the
# operands exactly as for a GPU and no interpreter-only upcast can hide a dtype mismatch: tl.dot's
# operand check runs in the interpreter as in the compiler. bf16 with bf16 keeps the interpreter rule:
# numpy has no bfloat16 and the interpreter's bf16 dot is wrong.
TRITON_DTYPES_SCRIPT = textwrap.dedent(
    """
    import json, os, types, torch
    from otbrl import fused_triton
    from otbrl.fused import fused_token_stats
    from tests.core.test_fused import case, reference
    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    as_on_gpu = types.SimpleNamespace(environ={})
    out = {}
    for hd, wd in ((bf16, f32), (f16, f32), (f32, bf16), (bf16, f16), (f16, f16), (bf16, bf16), (f32, f32)):
        fused_triton.os = os if hd == wd == bf16 else as_on_gpu
        hidden, weight, tokens, bias = case(n=45, h=40, v=150)
        hidden, weight = hidden.to(hd), weight.to(wd)
        key = f"{hd}-{wd}".replace("torch.", "")
        try:
            got = fused_token_stats(hidden, weight, tokens, 0.7, bias, backend="triton")
        except Exception as err:
            out[key] = f"{type(err).__name__}: {err}"[:300]
            continue
        ref = reference(hidden, weight, tokens, 0.7, bias)
        out[key] = max(((a.double() - b).abs() / b.abs()).max().item() for a, b in zip(got, ref))
    print(json.dumps(out))
    """
)


# The limit of float32 logits against float64 ones: one peaked row of this case (entropy 0.032) carries
# a relative entropy error of 6e-6 on the torch path and 1.3e-5 in the kernel with 128-wide vocabulary
# blocks, from the rounding of its logits alone (the kernel's entropy sums same-signed terms).
FLOAT32_LOGITS_TOL = 3e-5


def test_triton_kernel_mixed_and_low_precision_dtypes():
    errors = run_interpreted(TRITON_DTYPES_SCRIPT)
    for key, err in errors.items():
        assert isinstance(err, float), (key, err)
        assert err <= FLOAT32_LOGITS_TOL, (key, err)


TRITON_NEG_INF_SCRIPT = textwrap.dedent(
    """
    import json, math, torch
    from otbrl.fused import fused_token_stats
    from tests.core.test_fused import masked_case, reference
    out = {}
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(3, 4, generator=g), torch.randn(5, 4, generator=g)
    small = (hidden, weight, torch.tensor([1, 2, 3]), torch.tensor([-math.inf, 0, 0, 0, 0]))
    cases = {  # vocabulary tiles of 64: [0, 64), [64, 128), [128, 150)
        "one-entry": small,
        "first-tile": masked_case(masked=range(0, 64), n=9),
        "last-partial-tile": masked_case(masked=range(128, 150), n=9),
        "two-tiles-and-scattered": masked_case(masked=[*range(0, 64), *range(128, 150), 70, 99], n=9),
    }
    for key, (hidden, weight, tokens, bias) in cases.items():
        got = fused_token_stats(hidden, weight, tokens, 0.8, bias, backend="triton")
        ref = reference(hidden, weight, tokens, 0.8, bias)
        out[key] = max(((a.double() - b).abs() / b.abs()).max().item() for a, b in zip(got, ref))
    hidden, weight, tokens, bias = masked_case(masked=[3], n=9)
    for key, change in (("label", lambda: tokens.__setitem__(4, 3)), ("row", lambda: bias.fill_(-math.inf))):
        change()
        try:
            fused_token_stats(hidden, weight, tokens, 1.0, bias, backend="triton")
            out["raise-" + key] = "no error"
        except ValueError as err:
            out["raise-" + key] = str(err)
    print(json.dumps(out))
    """
)


def test_triton_kernel_neg_inf_logits():
    out = run_interpreted(TRITON_NEG_INF_SCRIPT)
    assert out.pop("raise-label").startswith("tokens: a sampled token has logit -inf")
    assert out.pop("raise-row").startswith("hidden: produce non-finite logits")
    assert len(out) == 4
    for key, err in out.items():
        assert err <= 1e-5, (key, err)  # NaN fails here too

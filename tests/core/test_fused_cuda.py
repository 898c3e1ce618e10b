"""otbrl.fused on a CUDA GPU: the Triton kernel compiled for the device (not the interpreter), with real
tensor-core bf16/fp16 dots and real vocabulary sizes, against the float64 reference; the "auto" backend's
choice; and the energy of a small model's completions in bf16 on the GPU. Skipped without CUDA and
Triton (CI has neither); run on a GPU machine with `pytest tests/core/test_fused_cuda.py`."""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch

from otbrl import fused
from otbrl.fused import fused_token_stats
from tests.core.test_fused import FLOAT32_LOGITS_TOL, assert_rel, case, masked_case, reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("triton")
from otbrl import fused_triton  # noqa: E402  (imports triton)

CUDA = torch.device("cuda")

f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16


def on_gpu(*tensors):
    return [None if t is None else t.to(CUDA) for t in tensors]


@pytest.mark.parametrize(
    ("hidden_dtype", "weight_dtype"),
    [(f32, f32), (bf16, bf16), (f16, f16), (bf16, f32), (f16, f32), (f32, bf16), (bf16, f16)],
)
@pytest.mark.parametrize(("temperature", "with_bias"), [(1.0, False), (0.7, True)])
def test_compiled_kernel_matches_float64_reference(hidden_dtype, weight_dtype, temperature, with_bias):
    # sizes that are not multiples of the blocks (32 rows, 64 vocabulary, 32 hidden)
    hidden, weight, tokens, bias = case(n=45, h=40, v=150)
    hidden, weight = hidden.to(hidden_dtype), weight.to(weight_dtype)
    bias = bias if with_bias else None
    hidden, weight, tokens, bias = on_gpu(hidden, weight, tokens, bias)
    got = fused_token_stats(hidden, weight, tokens, temperature, bias, backend="triton")
    assert got.energy.is_cuda and got.energy.dtype == f32
    # The reference reads the same (rounded) inputs in float64: only the float32 logits separate them.
    assert_rel(got, reference(hidden, weight, tokens, temperature, bias), FLOAT32_LOGITS_TOL)


@pytest.mark.parametrize(("vocab", "hidden_size"), [(49152, 576), (151936, 896)])
def test_compiled_kernel_at_real_vocabulary_sizes_in_bf16(vocab, hidden_size):
    """SmolLM2-135M's and Qwen2.5-0.5B's head shapes, bf16 hidden states and head, as in training."""
    g = torch.Generator().manual_seed(vocab)
    hidden = torch.randn(300, hidden_size, generator=g).to(bf16)
    weight = (torch.randn(vocab, hidden_size, generator=g) * 3 * hidden_size**-0.5).to(bf16)
    tokens = torch.randint(0, vocab, (300,), generator=g)
    hidden, weight, tokens = on_gpu(hidden, weight, tokens)
    got = fused_token_stats(hidden, weight, tokens, 1.0, backend="triton")
    assert_rel(got, reference(hidden, weight, tokens), 1e-4)


def test_confident_tokens_keep_relative_accuracy_on_the_gpu():
    """Near-deterministic rows (logit gaps of 20-60, energies down to ~1e-26): the kernel keeps the
    energy's relative accuracy, which 1 - 2p + sum p^2 would lose entirely."""
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(2000, 32, generator=g)
    tokens = torch.randint(0, 2000, (64,), generator=g)
    hidden = weight[tokens] * torch.linspace(0.5, 2.0, 64)[:, None]
    hidden, weight, tokens = on_gpu(hidden, weight, tokens)
    got = fused_token_stats(hidden, weight, tokens, 1.0, backend="triton")
    ref = reference(hidden, weight, tokens)
    assert (got.energy >= 0).all() and ref[2].min() < 1e-20
    assert ((got.energy.double() - ref[2]).abs() / ref[2]).max().item() < 1e-4


def test_compiled_kernel_with_neg_inf_logits_and_bad_rows():
    for masked in (range(0, 64), range(128, 150), [*range(0, 64), *range(128, 150), 70, 99]):
        hidden, weight, tokens, bias = on_gpu(*masked_case(masked=masked, n=9))
        got = fused_token_stats(hidden, weight, tokens, 0.8, bias, backend="triton")
        ref = reference(hidden, weight, tokens, 0.8, bias)
        assert all(torch.isfinite(s).all() for s in got)
        assert_rel(got, ref, 1e-5)
    hidden, weight, tokens, bias = masked_case(masked=[3], n=9)
    tokens[4] = 3
    with pytest.raises(ValueError, match="a sampled token has logit -inf"):
        hidden, weight, tokens, bias = on_gpu(hidden, weight, tokens, bias)
        fused_token_stats(hidden, weight, tokens, 1.0, bias, backend="triton")
    with pytest.raises(ValueError, match="non-finite logits"):
        fused_token_stats(hidden, weight, tokens.clamp(max=2), 1.0, bias.fill_(-math.inf), backend="triton")


def test_auto_picks_triton_on_cuda_and_agrees_with_the_torch_path():
    hidden, weight, tokens, bias = on_gpu(*case(n=200, h=64, v=1000, dtype=bf16))
    kernel_fn = fused_triton.triton_token_stats
    with mock.patch.object(fused_triton, "triton_token_stats", wraps=kernel_fn) as kernel:
        auto = fused_token_stats(hidden, weight, tokens, 0.9, bias)
    assert kernel.call_count == 1
    by_torch = fused_token_stats(hidden, weight, tokens, 0.9, bias, backend="torch")
    assert by_torch.energy.is_cuda
    for a, b in zip(auto, by_torch, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # float64 stays on the torch path, in float64
    h64, w64, t64, b64 = on_gpu(*case(n=20, h=16, v=100, dtype=torch.float64))
    assert not fused._triton_usable(h64, w64)
    assert fused_token_stats(h64, w64, t64, 1.0, b64).energy.dtype == torch.float64


def test_completion_energy_of_a_bf16_model_on_the_gpu():
    """A small Llama in bf16 on the GPU: the hidden-state path (Triton) gives the energy of the model's
    own logits (from_logits), and check_head accepts the bf16 head."""
    transformers = pytest.importorskip("transformers")
    from otbrl.lm import check_head, completion_energy

    config = transformers.LlamaConfig(
        vocab_size=3000,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(CUDA, bf16)
    ids = torch.randint(0, 3000, (4, 40), device=CUDA)
    attn = torch.ones_like(ids)
    attn[1, :5] = 0  # left padding
    transform = check_head(model)
    fused_path = completion_energy(model, ids, attn, 24, 0.8, transform=transform)
    logits_path = completion_energy(model, ids, attn, 24, 0.8, from_logits=True)
    assert fused_path.shape == (4, 24) and torch.isfinite(fused_path).all()
    # bf16 logits round to ~3 significant digits; the fused path keeps float32 accumulation
    torch.testing.assert_close(fused_path, logits_path, rtol=3e-2, atol=3e-3)

"""Tests for otbrl.energy: Σπ², the per-token energy ||e_y - softmax(z/T)||², and realized energy W_t.

References are plain float64 Python (math.fsum over rows), never taken from otbrl.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import otbrl
import otbrl.energy as energy_mod

TEMPERATURES = (0.5, 1.0, 1.7)
SHAPES = ((11,), (5, 13), (2, 3, 17))  # (V,), (N, V), (B, T, V)


# ----------------------------------------------------------------------------------------------------------
# float64 references
# ----------------------------------------------------------------------------------------------------------


def _probs(row: list[float], temperature: float) -> list[float]:
    """softmax(row / T) in float64; -inf entries get probability 0."""
    x = [v / temperature for v in row]
    top = max(x)
    e = [math.exp(v - top) for v in x]
    total = math.fsum(e)
    return [v / total for v in e]


def _rows(logits: torch.Tensor, tokens: torch.Tensor | None = None):
    rows = logits.double().reshape(-1, logits.shape[-1]).tolist()
    ids = [None] * len(rows) if tokens is None else tokens.reshape(-1).tolist()
    return rows, ids


def ref_sum_pi_sq(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    rows, _ = _rows(logits)
    out = [math.fsum(q * q for q in _probs(r, temperature)) for r in rows]
    return torch.tensor(out, dtype=torch.float64).reshape(logits.shape[:-1])


def ref_energy(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """||onehot(y) - softmax(z/T)||² straight from the definition."""
    rows, ids = _rows(logits, tokens)
    out = []
    for r, y in zip(rows, ids, strict=True):
        p = _probs(r, temperature)
        out.append(math.fsum((float(v == y) - q) ** 2 for v, q in enumerate(p)))
    return torch.tensor(out, dtype=torch.float64).reshape(tokens.shape)


def ref_energy_confident(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Same quantity, 1 - pi_y written as sum_{v != y} pi_v: exact in float64 even when pi_y rounds to 1."""
    rows, ids = _rows(logits, tokens)
    out = []
    for r, y in zip(rows, ids, strict=True):
        others = [q for v, q in enumerate(_probs(r, temperature)) if v != y]
        out.append(math.fsum(others) ** 2 + math.fsum(q * q for q in others))
    return torch.tensor(out, dtype=torch.float64).reshape(tokens.shape)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return (got.double() - ref).abs() / ref.abs()


def random_case(shape, dtype=torch.float32, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)
    tokens = torch.randint(0, shape[-1], shape[:-1], generator=g)
    return logits, tokens


def confident_case(vocab, gaps, dtype=torch.float32, seed=0):
    """One logit per row `gap` above the max of N(0, 1) others; the sampled token is that argmax."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(gaps), vocab, generator=g, dtype=torch.float64)
    top = torch.randint(0, vocab, (len(gaps),), generator=g)
    logits[torch.arange(len(gaps)), top] = logits.amax(-1) + torch.tensor(gaps, dtype=torch.float64)
    return logits.to(dtype), top


# ----------------------------------------------------------------------------------------------------------
# agreement with the float64 definition
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("dtype", "rtol"), [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_matches_float64_definition(shape, temperature, dtype, rtol):
    logits, tokens = random_case(shape, dtype)
    spsq = otbrl.sum_pi_squared(logits, temperature)
    w = otbrl.token_energy(logits, tokens, temperature)
    assert spsq.shape == w.shape == shape[:-1]
    assert rel_err(spsq, ref_sum_pi_sq(logits, temperature)).max() <= rtol
    assert rel_err(w, ref_energy(logits, tokens, temperature)).max() <= rtol


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_energy_is_squared_logit_gradient_norm(temperature):
    # d log_softmax(z/T)_y / dz = (e_y - pi) / T, so ||grad||² * T² = w.
    logits, tokens = random_case((6, 19), torch.float64, seed=1)
    z = logits.clone().requires_grad_(True)
    logp = torch.log_softmax(z / temperature, dim=-1).gather(-1, tokens[:, None]).sum()
    (grad,) = torch.autograd.grad(logp, z)  # rows are independent, so each row holds its own gradient
    expected = grad.square().sum(-1) * temperature**2
    torch.testing.assert_close(
        otbrl.token_energy(logits, tokens, temperature), expected, rtol=1e-12, atol=1e-15
    )


# ----------------------------------------------------------------------------------------------------------
# chunking
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("chunk_rows", "expected_tiles"), [(3, [3, 3, 3, 1]), (1, [1] * 10), (4, [4, 4, 2])])
def test_chunked_equals_unchunked(monkeypatch, chunk_rows, expected_tiles):
    logits, tokens = random_case((2, 5, 23), seed=2)  # 10 rows of V = 23
    full_spsq = otbrl.sum_pi_squared(logits, 1.7)
    full_w = otbrl.token_energy(logits, tokens, 1.7)

    tiles = []
    real_tiles = energy_mod._tiles

    def spy(*args):
        for rows, e in real_tiles(*args):
            tiles.append(e.shape[0])
            yield rows, e

    monkeypatch.setattr(energy_mod, "_tiles", spy)
    # chunk_rows * V + 1 elements still allows only chunk_rows rows per tile.
    monkeypatch.setattr(energy_mod, "CHUNK_ELEMENTS", chunk_rows * 23 + (chunk_rows > 1))
    torch.testing.assert_close(otbrl.sum_pi_squared(logits, 1.7), full_spsq, rtol=1e-6, atol=0)
    torch.testing.assert_close(otbrl.token_energy(logits, tokens, 1.7), full_w, rtol=1e-6, atol=0)
    assert tiles == expected_tiles * 2


# ----------------------------------------------------------------------------------------------------------
# numerics
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_bf16_input_accumulates_in_fp32(temperature):
    logits, tokens = random_case((4, 2048), torch.bfloat16, seed=3)
    spsq = otbrl.sum_pi_squared(logits, temperature)
    w = otbrl.token_energy(logits, tokens, temperature)
    assert spsq.dtype == w.dtype == torch.float32
    # The reference sees the same bf16 values, upcast; only the fp32 accumulation differs.
    assert rel_err(spsq, ref_sum_pi_sq(logits, temperature)).max() <= 1e-5
    assert rel_err(w, ref_energy(logits, tokens, temperature)).max() <= 1e-5


@pytest.mark.parametrize("scale", [1e3, 1e4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_huge_logits(scale, dtype):
    logits, tokens = random_case((8, 64), dtype, scale=scale, seed=4)
    tokens[:4] = logits[:4].argmax(-1)  # half confident, half hopeless
    spsq = otbrl.sum_pi_squared(logits, 1.7)
    w = otbrl.token_energy(logits, tokens, 1.7)
    assert torch.isfinite(spsq).all() and torch.isfinite(w).all()
    torch.testing.assert_close(spsq.double(), ref_sum_pi_sq(logits, 1.7), rtol=1e-6, atol=1e-30)
    torch.testing.assert_close(w.double(), ref_energy_confident(logits, tokens, 1.7), rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("vocab", [32768, 151936])
def test_confident_tokens_keep_relative_accuracy_where_textbook_fails(vocab):
    gaps = [15.0, 20.0, 30.0, 40.0]
    logits, top = confident_case(vocab, gaps)
    w = otbrl.token_energy(logits, top)
    ref = ref_energy_confident(logits, top)
    assert (w >= 0).all()
    assert rel_err(w, ref).max() < 1e-4

    # The pitfall: 1 - 2 pi_y + sum pi² from separately rounded fp32 pieces (sum pi² as in section 3,
    # exp(lse(2z) - 2 lse(z))) goes negative or loses every digit on exactly these rows.
    logp_y = torch.log_softmax(logits, -1).gather(-1, top[:, None]).squeeze(-1)
    spsq = torch.exp(torch.logsumexp(2 * logits, -1) - 2 * torch.logsumexp(logits, -1))
    textbook = 1 - 2 * logp_y.exp() + spsq
    assert (textbook < 0).any()
    assert ((textbook < 0) | (rel_err(textbook, ref) > 0.5)).all()


def test_extremely_confident_tokens_never_negative():
    gaps = [45.0, 50.0, 60.0]
    logits, top = confident_case(151936, gaps)
    w32 = otbrl.token_energy(logits, top)
    ref = ref_energy_confident(logits, top)
    assert (w32 >= 0).all()
    # These energies (~1e-35..1e-49) sit at or below fp32's normal range: only absolute accuracy is possible.
    assert ((w32.double() - ref).abs() <= 1e-37).all()
    # From float64 logits the result is float64 and keeps full relative accuracy.
    w64 = otbrl.token_energy(logits.double(), top)
    assert rel_err(w64, ref).max() < 1e-10


def test_very_unlikely_sampled_token():
    logits, top = confident_case(32768, [20.0, 30.0, 40.0])
    unlikely = logits.argmin(-1)
    w = otbrl.token_energy(logits, unlikely)
    spsq = otbrl.sum_pi_squared(logits)
    torch.testing.assert_close(w, 1 + spsq, rtol=1e-6, atol=0)
    assert rel_err(w, ref_energy(logits, unlikely)).max() < 1e-6
    assert (w <= 2).all()  # the true 2 - 2 pi_y - ... rounds to exactly 2.0 in fp32 here


def test_masked_vocab_entries():
    logits, tokens = random_case((3, 4, 10), seed=5)
    cols = torch.tensor([1, 2, 4, 7, 8, 11, 13, 17, 20, 23])  # finite columns; the other 15 are -inf
    masked = torch.full((3, 4, 25), -math.inf)
    masked[..., cols] = logits
    assert rel_err(otbrl.sum_pi_squared(masked, 0.5), ref_sum_pi_sq(logits, 0.5)).max() <= 1e-6
    assert (
        rel_err(otbrl.token_energy(masked, cols[tokens], 0.5), ref_energy(logits, tokens, 0.5)).max() <= 1e-6
    )
    # Sampling a masked entry: pi_y = 0, so w = 1 + sum pi².
    w_masked = otbrl.token_energy(masked, torch.zeros(3, 4, dtype=torch.long), 0.5)
    assert rel_err(w_masked, 1 + ref_sum_pi_sq(logits, 0.5)).max() <= 1e-6


# ----------------------------------------------------------------------------------------------------------
# validation, dtypes, purity
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "poison",
    [
        pytest.param(lambda z: z[1].fill_(-math.inf), id="all-neg-inf-row"),
        pytest.param(lambda z: z[0, 3].fill_(math.nan), id="nan"),
        pytest.param(lambda z: z[2, 0].fill_(math.inf), id="pos-inf"),
    ],
)
def test_bad_logits_raise(poison):
    logits, tokens = random_case((3, 7), seed=6)
    poison(logits)
    with pytest.raises(ValueError, match="logits"):
        otbrl.sum_pi_squared(logits)
    with pytest.raises(ValueError, match="logits"):
        otbrl.token_energy(logits, tokens)


@pytest.mark.parametrize("temperature", [0.0, -1.0, math.nan, math.inf, -math.inf])
def test_bad_temperature_raises(temperature):
    logits, tokens = random_case((3, 7))
    with pytest.raises(ValueError, match="temperature"):
        otbrl.sum_pi_squared(logits, temperature)
    with pytest.raises(ValueError, match="temperature"):
        otbrl.token_energy(logits, tokens, temperature)


@pytest.mark.parametrize(
    "tokens",
    [
        pytest.param(torch.tensor([0, 1, 7]), id="too-large"),
        pytest.param(torch.tensor([0, -1, 2]), id="negative"),
        pytest.param(torch.tensor([0.0, 1.0, 2.0]), id="float"),
        pytest.param(torch.tensor([[0, 1, 2]]), id="shape"),
        pytest.param(torch.tensor([0, 1]), id="short"),
        pytest.param([0, 1, 2], id="list"),
    ],
)
def test_bad_tokens_raise(tokens):
    logits, _ = random_case((3, 7))
    with pytest.raises(ValueError, match="tokens"):
        otbrl.token_energy(logits, tokens)


@pytest.mark.parametrize(
    ("dtype", "out_dtype"),
    [
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
        (torch.float32, torch.float32),
        (torch.float64, torch.float64),
    ],
)
def test_output_dtype_and_input_untouched(dtype, out_dtype):
    logits, tokens = random_case((2, 3, 9), dtype, seed=7)
    logits[0, 0, 4] = -math.inf
    before, tokens_before = logits.clone(), tokens.clone()
    assert otbrl.sum_pi_squared(logits, 1.7).dtype == out_dtype
    assert otbrl.token_energy(logits, tokens, 1.7).dtype == out_dtype
    assert otbrl.token_energy(logits, tokens).dtype == out_dtype
    assert torch.equal(logits, before) and torch.equal(tokens, tokens_before)


def test_non_contiguous_and_empty_inputs():
    logits, tokens = random_case((6, 2 * 15), torch.float64, seed=10)
    view = logits[::2, ::2]  # strided in both dimensions
    ids = tokens[::2] % 15
    assert rel_err(otbrl.sum_pi_squared(view), ref_sum_pi_sq(view)).max() <= 1e-12
    assert rel_err(otbrl.token_energy(view, ids), ref_energy(view, ids)).max() <= 1e-12
    empty = torch.zeros(0, 3, 7)
    assert otbrl.sum_pi_squared(empty).shape == (0, 3)
    assert otbrl.token_energy(empty, torch.zeros(0, 3, dtype=torch.long)).shape == (0, 3)


# ----------------------------------------------------------------------------------------------------------
# token_energy_from_logprobs
# ----------------------------------------------------------------------------------------------------------


def test_from_logprobs_matches_reference_with_exact_stats():
    logits, tokens = random_case((4, 6, 31), torch.float64, seed=8)
    logprobs = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    w = otbrl.token_energy_from_logprobs(logprobs, ref_sum_pi_sq(logits))
    assert w.dtype == torch.float64
    torch.testing.assert_close(w, ref_energy(logits, tokens), rtol=1e-9, atol=1e-15)


def test_from_logprobs_clamps_at_zero():
    logprobs = torch.tensor([-1e-9, -1e-6, -1e-12], dtype=torch.float64)
    pi_y = logprobs.exp()
    sum_pi_sq = pi_y.square() - 1e-15  # inconsistent by rounding: slightly below pi_y²
    assert ((1 - 2 * pi_y + sum_pi_sq) < 0).any()  # the textbook form is negative here
    assert (otbrl.token_energy_from_logprobs(logprobs, sum_pi_sq) >= 0).all()


def test_from_logprobs_never_negative_on_fp32_stats():
    logits, top = confident_case(32768, [10.0, 12.0, 15.0, 20.0, 30.0])
    logprobs = torch.log_softmax(logits, -1).gather(-1, top[:, None]).squeeze(-1)
    w = otbrl.token_energy_from_logprobs(logprobs, otbrl.sum_pi_squared(logits))
    assert w.dtype == torch.float32
    assert (w >= 0).all()


def test_from_logprobs_stays_within_bounds_implied_by_logprob():
    # sum_{v != y} pi_v^2 lies in [0, (1 - pi_y)^2], so w lies between expm1(lp)^2 and twice that, whatever
    # the rounding in sum_pi_sq (a clamp at 0 alone returned 0 or far too much on fp32 confident tokens).
    logits, top = confident_case(32768, [8.0, 10.0, 12.0, 15.0, 20.0] * 4)
    logprobs = torch.log_softmax(logits, -1).gather(-1, top[:, None]).squeeze(-1)
    w = otbrl.token_energy_from_logprobs(logprobs, otbrl.sum_pi_squared(logits)).double()
    lower = torch.expm1(logprobs.double()).square()
    assert (w >= lower * (1 - 1e-5)).all()
    assert (w <= 2 * lower * (1 + 1e-5)).all()


@pytest.mark.parametrize(
    ("logprobs", "sum_pi_sq", "name"),
    [
        (torch.zeros(3), torch.ones(4), "sum_pi_sq"),
        (torch.tensor([-0.1, math.nan]), torch.ones(2), "logprobs"),
        (torch.tensor([-0.1, -0.2]), torch.tensor([0.5, math.nan]), "sum_pi_sq"),
        (torch.tensor([-0.1, -math.inf]), torch.ones(2), "logprobs"),
    ],
)
def test_from_logprobs_bad_input_raises(logprobs, sum_pi_sq, name):
    with pytest.raises(ValueError, match=name):
        otbrl.token_energy_from_logprobs(logprobs, sum_pi_sq)


# ----------------------------------------------------------------------------------------------------------
# realized_energy
# ----------------------------------------------------------------------------------------------------------


def ref_realized(energy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    out = []
    for w_row, m_row in zip(energy.double().tolist(), mask.tolist(), strict=True):
        total, row = 0.0, []
        for w, m in zip(w_row, m_row, strict=True):
            if m:
                total += w
            row.append(total)
        out.append(row)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.float32])
def test_realized_energy_carries_through_tool_tokens(mask_dtype):
    energy = torch.tensor([[0.5, 0.25, 9.0, 9.0, 0.125, 1.0], [1.0, 1.0, 1.0, 1.0, 1.0, 9.0]])
    mask = torch.tensor([[1, 1, 0, 0, 1, 1], [0, 1, 1, 0, 1, 0]]).to(mask_dtype)
    expected = torch.tensor([[0.5, 0.75, 0.75, 0.75, 0.875, 1.875], [0.0, 1.0, 2.0, 2.0, 3.0, 3.0]])
    got = otbrl.realized_energy(energy, mask)
    assert got.dtype == torch.float32  # float64 only for float64 energy
    assert otbrl.realized_energy(energy.double(), mask).dtype == torch.float64
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    torch.testing.assert_close(got.double(), ref_realized(energy, mask), rtol=0, atol=0)


def test_realized_energy_never_reads_masked_values():
    energy, _ = random_case((4, 12, 1), seed=9)
    energy = energy.squeeze(-1).abs()
    mask = (torch.arange(12) % 3 != 1).long().expand(4, 12)
    poisoned = torch.where(mask.bool(), energy, torch.tensor(math.nan))
    got = otbrl.realized_energy(poisoned, mask)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), ref_realized(energy, mask))


def test_realized_energy_shape_mismatch_raises():
    with pytest.raises(ValueError, match="energy"):
        otbrl.realized_energy(torch.ones(2, 5), torch.ones(2, 4))


# ----------------------------------------------------------------------------------------------------------
# properties
# ----------------------------------------------------------------------------------------------------------

rows = st.lists(st.floats(-10.0, 10.0, allow_nan=False, allow_infinity=False), min_size=1, max_size=12)


@settings(max_examples=100, deadline=None)
@given(row=rows, data=st.data(), temperature=st.sampled_from(TEMPERATURES))
def test_property_bounds_and_identity(row, data, temperature):
    vocab = len(row)
    y = data.draw(st.integers(0, vocab - 1))
    logits = torch.tensor(row, dtype=torch.float64)
    spsq = otbrl.sum_pi_squared(logits, temperature).item()
    w = otbrl.token_energy(logits, torch.tensor(y), temperature).item()
    pi_y = _probs(row, temperature)[y]
    assert 0.0 <= w < 2.0
    assert 1.0 / vocab * (1 - 1e-12) <= spsq <= 1.0 + 1e-12
    assert w == pytest.approx(1 - 2 * pi_y + spsq, abs=1e-5)


@settings(max_examples=100, deadline=None)
@given(row=rows, shift=st.floats(-50.0, 50.0), data=st.data(), temperature=st.sampled_from(TEMPERATURES))
def test_property_shift_invariance(row, shift, data, temperature):
    y = torch.tensor(data.draw(st.integers(0, len(row) - 1)))
    logits = torch.tensor(row, dtype=torch.float64)
    shifted = logits + shift
    assert otbrl.sum_pi_squared(shifted, temperature).item() == pytest.approx(
        otbrl.sum_pi_squared(logits, temperature).item(), rel=1e-9
    )
    assert otbrl.token_energy(shifted, y, temperature).item() == pytest.approx(
        otbrl.token_energy(logits, y, temperature).item(), rel=1e-9, abs=1e-15
    )

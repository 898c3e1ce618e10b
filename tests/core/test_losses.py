"""otbrl.losses against float64 loop references: every aggregation, its gradient, PPO clipping, masked
tokens (hypothesis), empty batches, low-precision input and bad input."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import otbrl
from otbrl.losses import policy_gradient_loss, policy_gradient_loss_with_stats

AGGREGATIONS = ["token-mean", "sequence-mean", "constant"]


def random_inputs(seed: int, rows: int = 5, width: int = 7, *, empty_row: bool = True) -> dict:
    """logprobs (<= 0), advantages, old_logprobs and a 0/1 float mask; garbage (NaN, -inf) where masked."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(rows, width, generator=g) < 0.7).double()
    mask[0, :] = 0.0 if empty_row else 1.0  # a row with no policy token
    mask[1, :] = 1.0
    logprobs = -torch.rand(rows, width, generator=g, dtype=torch.float64) * 3
    old = logprobs + 0.4 * torch.randn(rows, width, generator=g, dtype=torch.float64)
    adv = torch.randn(rows, width, generator=g, dtype=torch.float64)
    off = mask == 0
    return {
        "logprobs": logprobs.masked_fill(off, -math.inf),  # padding log-probs are often -inf
        "advantages": adv.masked_fill(off, math.nan),
        "old_logprobs": old.masked_fill(off, math.nan),
        "mask": mask,
    }


def loss_ref(
    logprobs, advantages, mask, *, old_logprobs=None, clip=None, aggregation="token-mean", normaliser=None
) -> float:
    """Plain float64 loops: per-token PPO loss, then the aggregation."""
    rows, width = mask.shape
    per_row, counts = [], []
    for i in range(rows):
        total, count = 0.0, 0
        for t in range(width):
            if mask[i, t] == 0:
                continue
            lp, a = float(logprobs[i, t]), float(advantages[i, t])
            r = 1.0 if old_logprobs is None else math.exp(lp - float(old_logprobs[i, t]))
            token = -r * a
            if clip is not None:
                low, high = clip
                token = max(token, -min(max(r, 1 - low), 1 + high) * a)
            total += token
            count += 1
        per_row.append(total)
        counts.append(count)
    if aggregation == "token-mean":
        return sum(per_row) / max(sum(counts), 1)
    if aggregation == "sequence-mean":
        return sum(s / max(c, 1) for s, c in zip(per_row, counts, strict=True)) / max(rows, 1)
    constant = width if normaliser is None else normaliser
    return sum(per_row) / (max(rows, 1) * constant)


def grad_ref(advantages, mask, aggregation, normaliser=None) -> torch.Tensor:
    """On-policy gradient of the loss wrt logprobs: -A m / (the aggregation's denominator), by loops."""
    rows, width = mask.shape
    out = torch.zeros(rows, width, dtype=torch.float64)
    tokens = sum(int(mask[i, t]) for i in range(rows) for t in range(width))
    for i in range(rows):
        length = sum(int(mask[i, t]) for t in range(width))
        for t in range(width):
            if mask[i, t] == 0:
                continue
            if aggregation == "token-mean":
                denominator = tokens
            elif aggregation == "sequence-mean":
                denominator = length * rows
            else:
                denominator = rows * (width if normaliser is None else normaliser)
            out[i, t] = -float(advantages[i, t]) / denominator
    return out


def with_grad(x: torch.Tensor) -> torch.Tensor:
    return x.clone().requires_grad_(True)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("seed", range(4))
def test_on_policy_loss_and_gradient_match_reference(aggregation, seed):
    x = random_inputs(seed)
    normaliser = 11.0 if aggregation == "constant" and seed % 2 else None
    logprobs = with_grad(x["logprobs"])
    loss = policy_gradient_loss(
        logprobs, x["advantages"], x["mask"], aggregation=aggregation, normaliser=normaliser
    )
    ref = loss_ref(x["logprobs"], x["advantages"], x["mask"], aggregation=aggregation, normaliser=normaliser)
    assert loss.dtype == torch.float64 and loss.shape == ()
    assert loss.item() == pytest.approx(ref, rel=1e-12, abs=1e-12)
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert torch.isfinite(grad).all()  # -inf padding log-probs must not leak NaN into the gradient
    torch.testing.assert_close(
        grad, grad_ref(x["advantages"], x["mask"], aggregation, normaliser), rtol=1e-12, atol=1e-15
    )


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("clip", [None, (0.2, 0.2), (0.2, 0.28), (0.1, 3.0)])
@pytest.mark.parametrize("seed", range(3))
def test_off_policy_clipped_loss_matches_reference(aggregation, clip, seed):
    x = random_inputs(seed, rows=6, width=9)
    loss = policy_gradient_loss(
        x["logprobs"],
        x["advantages"],
        x["mask"],
        old_logprobs=x["old_logprobs"],
        clip_eps=clip,
        aggregation=aggregation,
    )
    ref = loss_ref(
        x["logprobs"],
        x["advantages"],
        x["mask"],
        old_logprobs=x["old_logprobs"],
        clip=clip,
        aggregation=aggregation,
    )
    assert loss.item() == pytest.approx(ref, rel=1e-12, abs=1e-12)


def test_clipping_zeroes_the_gradient_exactly_where_the_clipped_branch_wins():
    # One row, four tokens: ratio 1.5 or 0.5, advantage + or -. With eps 0.2 the clipped branch wins
    # (zero gradient) for (r=1.5, A>0) and (r=0.5, A<0); the others keep the gradient -r A / n.
    old = torch.zeros(1, 4, dtype=torch.float64)
    r = torch.tensor([[1.5, 1.5, 0.5, 0.5]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]], dtype=torch.float64)
    logprobs = with_grad(r.log())
    out = policy_gradient_loss_with_stats(logprobs, adv, torch.ones(1, 4), old_logprobs=old, clip_eps=0.2)
    (grad,) = torch.autograd.grad(out.loss, logprobs)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 1.5 / 4, -0.5 / 4, 0.0]], dtype=torch.float64))
    assert out.clip_fraction.item() == pytest.approx(0.5)
    # Loss: clipped tokens contribute -1.2 * 1 and -0.8 * -1; the others -1.5 * -1 and -0.5 * 1.
    assert out.loss.item() == pytest.approx((-1.2 + 1.5 - 0.5 + 0.8) / 4)
    # Inside the clip range nothing changes: same as no clipping, clip fraction 0.
    near = with_grad(torch.full((1, 4), 0.05, dtype=torch.float64))
    a = policy_gradient_loss_with_stats(near, adv, torch.ones(1, 4), old_logprobs=old, clip_eps=0.2)
    b = policy_gradient_loss_with_stats(near, adv, torch.ones(1, 4), old_logprobs=old)
    assert a.clip_fraction.item() == 0.0
    assert a.loss.item() == b.loss.item()


def test_on_policy_ratio_is_one_so_clipping_changes_nothing():
    x = random_inputs(7)
    lp = with_grad(x["logprobs"])
    a = policy_gradient_loss_with_stats(lp, x["advantages"], x["mask"], clip_eps=0.2)
    b = policy_gradient_loss_with_stats(lp, x["advantages"], x["mask"], old_logprobs=x["logprobs"])
    (ga,) = torch.autograd.grad(a.loss, lp)
    (gb,) = torch.autograd.grad(b.loss, lp)
    torch.testing.assert_close(ga, gb)
    assert a.loss.item() == pytest.approx(b.loss.item())
    assert a.clip_fraction.item() == 0.0 and a.approx_kl.item() == 0.0


def test_approx_kl_is_k3_over_policy_tokens():
    x = random_inputs(3)
    out = policy_gradient_loss_with_stats(
        x["logprobs"], x["advantages"], x["mask"], old_logprobs=x["old_logprobs"]
    )
    terms = [
        math.exp(d) - 1 - d
        for d in (
            float(x["logprobs"][i, t] - x["old_logprobs"][i, t])
            for i in range(x["mask"].shape[0])
            for t in range(x["mask"].shape[1])
            if x["mask"][i, t] == 1
        )
    ]
    assert out.approx_kl.item() == pytest.approx(sum(terms) / len(terms), rel=1e-12)
    assert int(out.num_tokens) == len(terms)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    aggregation=st.sampled_from(AGGREGATIONS),
    clip=st.sampled_from([None, 0.2]),
    junk=st.sampled_from([math.nan, math.inf, -math.inf, 1e30, -3.0]),
)
def test_masked_tokens_contribute_nothing(seed, aggregation, clip, junk):
    x = random_inputs(seed, rows=4, width=6)
    off = x["mask"] == 0
    options = dict(clip_eps=clip, aggregation=aggregation)

    def loss_with(fill: float, logprobs_fill: float) -> tuple[torch.Tensor, torch.Tensor]:
        lp = with_grad(x["logprobs"].masked_fill(off, logprobs_fill))
        old = x["old_logprobs"].masked_fill(off, fill)
        adv = x["advantages"].masked_fill(off, fill)
        return policy_gradient_loss(lp, adv, x["mask"], old_logprobs=old, **options), lp

    base, _ = loss_with(0.0, -1.0)
    changed, lp = loss_with(junk, junk)
    assert changed.item() == base.item()
    (grad,) = torch.autograd.grad(changed, lp)
    assert torch.isfinite(grad).all()
    assert (grad[off] == 0).all()


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (3, 4)])
def test_batch_without_policy_tokens_gives_zero_with_zero_gradient(aggregation, shape):
    # Decision: 0, attached to the graph, so a rank or micro-batch holding only padding can still backward.
    logprobs = torch.randn(shape, requires_grad=True)
    loss = policy_gradient_loss(logprobs, torch.randn(shape), torch.zeros(shape), aggregation=aggregation)
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert logprobs.grad is not None and (logprobs.grad == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_low_precision_inputs_are_computed_in_float32(dtype, aggregation):
    x = random_inputs(5, rows=8, width=64, empty_row=False)
    mask = x["mask"]
    lp16 = with_grad(x["logprobs"].masked_fill(mask == 0, 0.0).to(dtype))
    adv16 = x["advantages"].masked_fill(mask == 0, 0.0).to(dtype)
    loss = policy_gradient_loss(lp16, adv16, mask, aggregation=aggregation)
    assert loss.dtype == torch.float32
    # Reference on the same (rounded) values in float64: the only error left is float32 accumulation.
    ref = loss_ref(lp16.detach().double(), adv16.double(), mask, aggregation=aggregation)
    assert loss.item() == pytest.approx(ref, rel=1e-5, abs=1e-6)
    (grad,) = torch.autograd.grad(loss, lp16)
    assert grad.dtype == dtype
    torch.testing.assert_close(
        grad.double(), grad_ref(adv16.double(), mask, aggregation), rtol=1e-2, atol=1e-4
    )


def test_float32_inputs_give_float32_and_any_float64_widens():
    x = random_inputs(2)
    lp = x["logprobs"].float()
    assert policy_gradient_loss(lp, x["advantages"].float(), x["mask"]).dtype == torch.float32
    assert policy_gradient_loss(lp, x["advantages"], x["mask"]).dtype == torch.float64


def test_token_mean_weights_tokens_equally_sequence_mean_weights_sequences():
    # Row 0: one token with A = 1; row 1: three tokens with A = 1. Gradient per token:
    # token-mean 1/4 everywhere; sequence-mean 1/2 on the short row and 1/6 on the long one; constant 1/(2*4).
    mask = torch.tensor([[1.0, 0, 0, 0], [1, 1, 1, 0]])
    adv = torch.ones(2, 4)
    expected = {
        "token-mean": [[0.25, 0, 0, 0], [0.25, 0.25, 0.25, 0]],
        "sequence-mean": [[0.5, 0, 0, 0], [1 / 6, 1 / 6, 1 / 6, 0]],
        "constant": [[0.125, 0, 0, 0], [0.125, 0.125, 0.125, 0]],
    }
    for aggregation, want in expected.items():
        lp = torch.zeros(2, 4, requires_grad=True)
        (grad,) = torch.autograd.grad(policy_gradient_loss(lp, adv, mask, aggregation=aggregation), lp)
        torch.testing.assert_close(grad, -torch.tensor(want))


def test_loss_feeds_on_compute_advantages_output():
    # The data flow end to end: energy -> advantages -> loss, with the advantages' own mask.
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 5, 11, generator=g)
    tokens = torch.randint(0, 11, (4, 5), generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]])
    res = otbrl.compute_advantages(
        "otb",
        rewards=torch.tensor([1.0, 0.0, 1.0, 0.0]),
        mask=mask,
        group_ids=[0, 0, 1, 1],
        energy=otbrl.token_energy(logits, tokens),
    )
    lp = with_grad(torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1))
    loss = otbrl.policy_gradient_loss(lp, res.advantages, mask)
    (grad,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(grad, -res.advantages * mask / mask.sum())


def test_bad_input_names_the_argument():
    lp, adv, mask = torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3)
    cases = [
        (dict(aggregation="mean"), "aggregation"),
        (dict(aggregation="dr_grpo"), "aggregation"),
        (dict(normaliser=4.0), "normaliser"),  # only for "constant"
        (dict(aggregation="constant", normaliser=0), "normaliser"),
        (dict(aggregation="constant", normaliser=math.inf), "normaliser"),
        (dict(aggregation="constant", normaliser=True), "normaliser"),
        (dict(clip_eps=0.0), "clip_eps"),
        (dict(clip_eps=1.0), "clip_eps"),
        (dict(clip_eps=(0.2,)), "clip_eps"),
        (dict(clip_eps=(0.2, -0.1)), "clip_eps"),
        (dict(clip_eps="0.2"), "clip_eps"),
        (dict(old_logprobs=torch.zeros(2, 4)), "old_logprobs"),
        (dict(old_logprobs=torch.full((2, 3), math.nan)), "old_logprobs"),
    ]
    for kwargs, name in cases:
        with pytest.raises(ValueError, match=f"^{name}:"):
            policy_gradient_loss(lp, adv, mask, **kwargs)
    with pytest.raises(ValueError, match="^logprobs:"):
        policy_gradient_loss(torch.zeros(2, 4), adv, mask)
    with pytest.raises(ValueError, match="^logprobs:"):
        policy_gradient_loss(torch.zeros(2, 3, dtype=torch.long), adv, mask)
    with pytest.raises(ValueError, match="^logprobs:"):
        policy_gradient_loss(torch.full((2, 3), -math.inf), adv, mask)
    with pytest.raises(ValueError, match="^advantages:"):
        policy_gradient_loss(lp, torch.zeros(3, 2), mask)
    with pytest.raises(ValueError, match="^advantages:"):
        policy_gradient_loss(lp, torch.full((2, 3), math.nan), mask)
    with pytest.raises(ValueError, match="^mask:"):
        policy_gradient_loss(lp, adv, torch.full((2, 3), 0.5))
    with pytest.raises(ValueError, match="^mask:"):
        policy_gradient_loss(lp, adv, torch.ones(6))


def test_no_gradient_flows_into_the_advantages():
    """Advantages may come from a value head: the policy loss must not train it."""
    logprobs = torch.zeros(2, 3, requires_grad=True)
    advantages = torch.ones(2, 3, requires_grad=True)
    otbrl.policy_gradient_loss(logprobs, advantages, torch.ones(2, 3)).backward()
    assert advantages.grad is None
    torch.testing.assert_close(logprobs.grad, torch.full((2, 3), -1 / 6))

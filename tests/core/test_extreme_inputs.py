"""Extreme and unusual inputs, and what the estimators decide on them: a lone trajectory at an interior
column with position alignment, finite but extreme inputs, and numpy / 0-d tensor temperatures."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import otbrl
from otbrl.inputs import check_temperature
from tests.references import otb_ref, random_batch

# ----------------------------------------------------------------------------------------------------
# (b) align="position" on masks with gaps: a trajectory alone at an interior column.


def gap_batch() -> dict:
    return {
        "rewards": torch.tensor([1.0, 0.0]),
        "mask": torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0]]),
        "group_ids": [0, 0],
        "energy": torch.ones(2, 3),
    }


def test_lone_trajectory_at_an_interior_column_gets_no_baseline():
    # W: row 0 = [1, 2, 3], row 1 = [1, -, 2]; column 1 has row 0 only.
    res = otbrl.compute_advantages("otb", **gap_batch())
    expected = torch.tensor([[1 - 0.5, 1 - 0.0, 1 - 3 / 5], [0 - 0.5, 0.0, 0 - 3 / 5]])
    torch.testing.assert_close(res.advantages, expected)
    loo = otbrl.compute_advantages("otb", leave_one_out=True, **gap_batch())
    assert loo.advantages[0, 1].item() == 1.0 and loo.baselines[0, 1].item() == 0.0


def test_without_zero_tail_the_lone_trajectory_is_its_own_baseline():
    # verl's TIR value: the self-inclusive weighted mean over one trajectory is its own return.
    res = otbrl.compute_advantages("otb", zero_tail=False, **gap_batch())
    assert res.baselines[0, 1].item() == pytest.approx(1.0)
    assert res.advantages[0, 1].item() == pytest.approx(0.0)
    adv, _ = otb_ref(**gap_batch(), zero_tail=False)
    torch.testing.assert_close(res.advantages.double(), adv)


# ----------------------------------------------------------------------------------------------------
# (d) Finite but extreme inputs: computed in float64 where float32 would overflow, or a clear error.


def grpo_ref(rewards: list[float], eps: float = 1e-6) -> list[float]:
    n = len(rewards)
    mean = sum(rewards) / n
    std = (sum((r - mean) ** 2 for r in rewards) / (n - 1)) ** 0.5
    return [(r - mean) / (std + eps) for r in rewards]


def test_grpo_with_rewards_near_float32_max():
    rewards = [2e38, -1e38, 1e38, 0.0]
    res = otbrl.compute_advantages(
        "grpo", rewards=torch.tensor(rewards), mask=torch.ones(4, 3), group_ids=[0, 0, 0, 0]
    )
    expected = torch.tensor(grpo_ref(rewards), dtype=torch.float64)[:, None].expand(4, 3)
    torch.testing.assert_close(res.advantages.double(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["rloo", "opo", "sob", "reinforce_pp_baseline"])
def test_sequence_estimators_with_huge_rewards_are_finite(name):
    kw = dict(mask=torch.ones(4, 3), group_ids=[0, 0, 1, 1], energy=torch.ones(4, 3))
    res = otbrl.compute_advantages(name, rewards=torch.tensor([1e38, -1e38, 3e37, 1e37]), **kw)
    assert torch.isfinite(res.advantages).all()
    small = otbrl.compute_advantages(name, rewards=torch.tensor([1e38, -1e38, 3e37, 1e37]).double(), **kw)
    torch.testing.assert_close(res.advantages, small.advantages)


@pytest.mark.parametrize("kind", ["list", "bfloat16"])
def test_huge_rewards_as_lists_or_bfloat16_are_widened_too(kind):
    rewards = [2e38, -1e38, 1e38, 0.0]
    given = rewards if kind == "list" else torch.tensor(rewards, dtype=torch.bfloat16)
    res = otbrl.compute_advantages("grpo", rewards=given, mask=torch.ones(4, 3), group_ids=[0, 0, 0, 0])
    exact = [float(r) for r in torch.as_tensor(given).double()]
    expected = torch.tensor(grpo_ref(exact), dtype=torch.float64)[:, None].expand(4, 3)
    torch.testing.assert_close(res.advantages.double(), expected, rtol=1e-6, atol=1e-6)


def test_advantages_beyond_float32_raise_a_clear_error():
    # R - mean = 3e38 - (-1e38) = 4e38 does not fit float32: an error, not inf.
    with pytest.raises(ValueError, match="advantages: estimator 'dr_grpo' gave inf"):
        otbrl.compute_advantages(
            "dr_grpo", rewards=torch.tensor([3e38, -3e38, -3e38]), mask=torch.ones(3, 2), group_ids=[0, 0, 0]
        )
    with pytest.raises(ValueError, match="returns: estimator 'grpo' gave inf"):
        otbrl.compute_advantages(
            "grpo", rewards=torch.full((2, 4), 2e38), mask=torch.ones(2, 4), group_ids=[0, 0]
        )


@pytest.mark.parametrize("options", [{}, {"leave_one_out": True}, {"align": "generated"}])
def test_otb_with_energy_near_float32_max(options):
    batch = random_batch(3, [4, 3], 6, allow_empty=False)
    batch = {k: (v.float() if v.is_floating_point() else v) for k, v in batch.items()}
    batch["energy"] = batch["energy"] * 1e38
    res = otbrl.compute_advantages("otb", **batch, **options)
    adv, _ = otb_ref(**{k: (v.double() if v.is_floating_point() else v) for k, v in batch.items()}, **options)
    torch.testing.assert_close(res.advantages.double(), adv, rtol=1e-5, atol=1e-5)


def test_otb_with_huge_importance_weights():
    # rho^2 = 1e40 overflows float32; the float32 attempt is redone in float64.
    batch = random_batch(4, [4, 3], 6, allow_empty=False)
    batch = {k: (v.float() if v.is_floating_point() else v) for k, v in batch.items()}
    rho = torch.rand(7, 6, generator=torch.Generator().manual_seed(0)) * 1e20
    res = otbrl.compute_advantages("otb", **batch, is_weights=rho)
    wide = {k: (v.double() if v.is_floating_point() else v) for k, v in batch.items()}
    adv, _ = otb_ref(**wide, is_weights=rho.double())
    torch.testing.assert_close(res.advantages.double(), adv, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------------
# (e) Temperatures: numpy scalars and 0-d tensors are real numbers too.


@pytest.mark.parametrize(
    "temperature",
    [np.float32(0.7), np.float64(0.7), np.float16(0.7), np.int64(2), torch.tensor(0.7), torch.tensor(2), 3],
)
def test_numpy_and_tensor_temperatures_are_accepted(temperature):
    assert check_temperature(temperature) == pytest.approx(float(temperature))
    logits = torch.randn(5, 7, generator=torch.Generator().manual_seed(0))
    tokens = torch.arange(5)
    torch.testing.assert_close(
        otbrl.token_energy(logits, tokens, temperature=temperature),
        otbrl.token_energy(logits, tokens, temperature=float(temperature)),
    )


@pytest.mark.parametrize(
    "temperature",
    [
        True,
        np.bool_(True),
        torch.tensor(True),
        float("nan"),
        np.float32("nan"),
        np.float64("inf"),
        0,
        -0.5,
        np.float32(-1.0),
        torch.tensor([0.7]),
        "0.7",
        None,
        1 + 0j,
    ],
)
def test_bad_temperatures_are_refused(temperature):
    with pytest.raises(ValueError, match="temperature: must be a finite number > 0"):
        check_temperature(temperature)


@pytest.mark.parametrize("name", ["otb", "grpo", "sob"])
def test_non_contiguous_inputs_give_the_same_result(name):
    batch = random_batch(5, [4, 4], 6)
    wide = {k: (torch.cat([v, v], dim=1) if v.dim() == 2 else v) for k, v in batch.items()}
    sliced = {k: (v[:, :6] if v.dim() == 2 else v) for k, v in wide.items()}
    assert not sliced["mask"].is_contiguous()
    floats = {k: (v.float() if v.is_floating_point() else v) for k, v in sliced.items()}
    plain = {k: v.contiguous() for k, v in floats.items()}
    got = otbrl.compute_advantages(name, **floats).advantages
    torch.testing.assert_close(got, otbrl.compute_advantages(name, **plain).advantages)


# ----------------------------------------------------------------------------------------------------
# The mask check (now casts and byte comparisons) and the caller's tensors stay untouched.


@pytest.mark.parametrize(
    "bad",
    [
        torch.tensor([[1.0, 0.5]]),
        torch.tensor([[1.5, 0.0]]),
        torch.tensor([[float("nan"), 1.0]]),
        torch.tensor([[-1.0, 1.0]]),
        torch.tensor([[1.0 - 1e-16, 1.0]], dtype=torch.float64),
        torch.tensor([[1.0, 1.0 - 2**-11]], dtype=torch.float16),
        torch.tensor([[2, 1]]),
        torch.tensor([[1, 255]], dtype=torch.uint8),
        torch.tensor([[-1, 0]], dtype=torch.int8),
    ],
)
def test_masks_that_are_not_zero_or_one_are_refused(bad):
    with pytest.raises(ValueError, match="mask: values must be 0 or 1"):
        otbrl.compute_advantages("grpo", rewards=torch.ones(1), mask=bad, group_ids=[0])


@pytest.mark.parametrize(
    "good",
    [
        torch.tensor([[1.0, -0.0]]),
        torch.tensor([[1, 0]], dtype=torch.uint8),
        torch.tensor([[1.0, 0.0]]).half(),
    ],
)
def test_masks_of_zeros_and_ones_in_any_dtype_are_accepted(good):
    res = otbrl.compute_advantages("grpo", rewards=torch.ones(1), mask=good, group_ids=[0])
    assert res.returns.tolist() == [[1.0, 0.0]]


@pytest.mark.parametrize("name", ["otb", "grpo", "reinforce_pp_baseline"])
def test_inputs_are_not_modified(name):
    batch = {k: (v.float() if v.is_floating_point() else v) for k, v in random_batch(6, [3, 3], 5).items()}
    before = {k: v.clone() for k, v in batch.items()}
    otbrl.compute_advantages(name, **batch, **({"is_weights": torch.ones(6, 5)} if name == "otb" else {}))
    for k, v in batch.items():
        assert torch.equal(v, before[k]), k


def test_transposed_mask_with_leave_one_out():
    """A column-major mask (numpy .T, Fortran order) in the usual block-per-group layout."""
    mask = torch.ones(3, 4).T
    res = otbrl.compute_advantages(
        "otb",
        rewards=[1.0, 0.0, 1.0, 0.0],
        mask=mask,
        group_ids=[0, 0, 1, 1],
        energy=torch.ones(4, 3),
        leave_one_out=True,
    )
    expected = torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None].expand(4, 3)  # baseline: the other's return
    torch.testing.assert_close(res.advantages, expected)


def test_a_mask_that_requires_grad_gives_plain_outputs():
    mask = torch.ones(2, 3, requires_grad=True)
    for name, scale in (("otb", 1.0), ("grpo", 2**0.5)):  # grpo divides by the std, 1 / sqrt(2)
        res = otbrl.compute_advantages(
            name, rewards=[1.0, 0.0], mask=mask, group_ids=[0, 0], energy=torch.ones(2, 3)
        )
        assert res.advantages.grad_fn is None
        torch.testing.assert_close(res.advantages[:, 0], torch.tensor([0.5, -0.5]) * scale, rtol=1e-5, atol=0)


def test_numpy_float64_rewards_are_float64_input():
    """1e8 + 1 and 1e8 differ in float64, not in float32."""
    rewards = np.array([1e8 + 1, 1e8])
    res = otbrl.compute_advantages("dr_grpo", rewards=rewards, mask=torch.ones(2, 1), group_ids=[0, 0])
    torch.testing.assert_close(res.advantages[:, 0], torch.tensor([0.5, -0.5]))

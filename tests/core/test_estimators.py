"""compute_advantages and every registered estimator against float64 loop references, the authors'
semantics, algebraic laws (hypothesis), edge cases and bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import otbrl
from tests.references import authors_otb_ref, otb_ref, random_batch, returns_ref, sequence_ref

SEQUENCE_ESTIMATORS = ["grpo", "dr_grpo", "rloo", "opo", "sob", "reinforce_pp_baseline"]
SIZES = [[1, 4, 3, 2], [4, 4], [2, 1, 5]]


def run(name: str, batch: dict, **options) -> otbrl.AdvantageResult:
    return otbrl.compute_advantages(name, **batch, **options)


@pytest.mark.parametrize("name", SEQUENCE_ESTIMATORS)
@pytest.mark.parametrize("token_rewards", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_sequence_estimators_match_reference(name, token_rewards, seed):
    batch = random_batch(seed, SIZES[seed], 7, token_rewards=token_rewards)
    res = run(name, batch)
    eps = 1e-6 if name == "grpo" else 1e-8
    ref = sequence_ref(name, batch["rewards"], batch["mask"], batch["group_ids"], batch["energy"], eps=eps)
    torch.testing.assert_close(res.advantages.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        res.returns.double(), returns_ref(batch["rewards"], batch["mask"]), rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize("leave_one_out", [False, True])
@pytest.mark.parametrize("align", ["position", "generated"])
@pytest.mark.parametrize("zero_tail", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_otb_matches_reference(leave_one_out, align, zero_tail, seed):
    batch = random_batch(seed, SIZES[seed % 3], 9, contiguous=seed % 2 == 0, token_rewards=seed == 3)
    opts = dict(leave_one_out=leave_one_out, align=align, zero_tail=zero_tail)
    res = run("otb", batch, **opts)
    adv, base = otb_ref(**batch, **opts)
    torch.testing.assert_close(res.advantages.double(), adv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(res.baselines.double(), base * batch["mask"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(4))
def test_otb_importance_weights_scale_energy(seed):
    batch = random_batch(seed, [3, 4], 8, contiguous=False)
    rho = (
        torch.rand(batch["mask"].shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        * 2
    )
    res = run("otb", batch, is_weights=rho, align="generated")
    adv, _ = otb_ref(**batch, is_weights=rho, align="generated")
    torch.testing.assert_close(res.advantages.double(), adv, rtol=1e-5, atol=1e-5)
    # Equivalent to passing the scaled energy directly.
    scaled = dict(batch, energy=batch["energy"] * rho**2)
    torch.testing.assert_close(res.advantages, run("otb", scaled, align="generated").advantages)


@pytest.mark.parametrize("seed", range(6))
def test_self_inclusive_otb_reproduces_authors_single_turn(seed):
    batch = random_batch(seed, SIZES[seed % 3], 10, contiguous=True)
    res = run("otb", batch)  # defaults: self-inclusive, position alignment, zero_tail
    ref = authors_otb_ref(**batch, multi_turn=False)
    torch.testing.assert_close(res.advantages.double(), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("seed", range(6))
def test_self_inclusive_otb_reproduces_authors_multi_turn(seed):
    batch = random_batch(seed, SIZES[seed % 3], 12, contiguous=False)
    res = run("otb", batch, align="generated")
    ref = authors_otb_ref(**batch, multi_turn=True)
    torch.testing.assert_close(res.advantages.double(), ref, rtol=1e-6, atol=1e-6)


def test_zero_tail_gives_longest_response_its_return():
    # Two responses of lengths 2 and 4: positions 2..3 of the long one have no peer.
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    energy = torch.full((2, 4), 0.5)
    kw = dict(rewards=torch.tensor([0.0, 1.0]), mask=mask, group_ids=[0, 0], energy=energy)
    on = otbrl.compute_advantages("otb", **kw)
    off = otbrl.compute_advantages("otb", zero_tail=False, **kw)
    loo = otbrl.compute_advantages("otb", leave_one_out=True, **kw)
    assert on.advantages[1, 2:].tolist() == [1.0, 1.0]
    assert off.advantages[1, 2:].abs().max() < 1e-6  # self-inclusive baseline is itself there
    assert loo.advantages[1, 2:].tolist() == [1.0, 1.0]
    # Where both are active, constant energy makes every form the plain mean (self-inclusive) ...
    assert on.baselines[:, :2].tolist() == [[0.5, 0.5], [0.5, 0.5]]
    # ... and the other's return (leave-one-out).
    assert loo.baselines[:, :2].tolist() == [[1.0, 1.0], [0.0, 0.0]]


def test_high_energy_trajectory_pulls_baseline_toward_its_return():
    mask = torch.ones(2, 3)
    energy = torch.tensor([[1.5, 1.5, 1.5], [0.01, 0.01, 0.01]])
    res = otbrl.compute_advantages(
        "otb", rewards=torch.tensor([0.0, 1.0]), mask=mask, group_ids=[7, 7], energy=energy
    )
    assert (res.baselines < 0.05).all()  # dominated by the high-energy trajectory's return 0
    expected = 0.03 / 4.53  # at t = 2: (0 * 4.5 + 1 * 0.03) / (4.5 + 0.03)
    assert res.baselines[0, 2].item() == pytest.approx(expected, rel=1e-6)


# ----------------------------------------------------------------------------------------------------
# Laws.

batch_params = dict(
    seed=st.integers(0, 10_000),
    sizes=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    length=st.integers(1, 9),
    contiguous=st.booleans(),
)
estimator_names = st.sampled_from(sorted(otbrl.ESTIMATORS))


def otb_options(draw_loo: bool, align: str) -> dict:
    return {"leave_one_out": draw_loo, "align": align}


@settings(max_examples=60, deadline=None)
@given(name=estimator_names, loo=st.booleans(), **batch_params)
def test_permuting_rows_permutes_outputs(name, loo, seed, sizes, length, contiguous):
    batch = random_batch(seed, sizes, length, contiguous=contiguous)
    opts = {"leave_one_out": loo, "align": "generated"} if name == "otb" else {}
    perm = torch.randperm(batch["mask"].shape[0], generator=torch.Generator().manual_seed(seed))
    permuted = {k: v[perm] for k, v in batch.items()}
    a, b = run(name, batch, **opts), run(name, permuted, **opts)
    for field in ("advantages", "returns", "baselines"):
        torch.testing.assert_close(getattr(a, field)[perm], getattr(b, field), rtol=1e-5, atol=1e-6)


@settings(max_examples=60, deadline=None)
@given(
    name=estimator_names,
    extra=st.integers(1, 4),
    align=st.sampled_from(["position", "generated"]),
    **batch_params,
)
def test_extra_padding_changes_nothing(name, extra, align, seed, sizes, length, contiguous):
    batch = random_batch(seed, sizes, length, contiguous=contiguous)
    opts = {"align": align} if name == "otb" else {}
    rows = batch["mask"].shape[0]
    padded = dict(batch)
    padded["mask"] = torch.cat([batch["mask"], torch.zeros(rows, extra, dtype=torch.float64)], dim=1)
    padded["energy"] = torch.cat(
        [batch["energy"], torch.full((rows, extra), 3.0, dtype=torch.float64)], dim=1
    )
    a, b = run(name, batch, **opts), run(name, padded, **opts)
    torch.testing.assert_close(b.advantages[:, :length], a.advantages)
    assert (b.advantages[:, length:] == 0).all() and (b.baselines[:, length:] == 0).all()


@settings(max_examples=60, deadline=None)
@given(name=estimator_names, **batch_params)
def test_masked_positions_are_zero_and_outputs_finite(name, seed, sizes, length, contiguous):
    batch = random_batch(seed, sizes, length, contiguous=contiguous)
    res = run(name, batch)
    off = batch["mask"] == 0
    for field in ("advantages", "returns", "baselines"):
        value = getattr(res, field)
        assert value.dtype == torch.float32 and value.shape == batch["mask"].shape
        assert torch.isfinite(value).all() and (value[off] == 0).all()


@settings(max_examples=60, deadline=None)
@given(c=st.floats(1e-3, 10.0), loo=st.booleans(), **batch_params)
def test_constant_energy_gives_mean_of_active_returns(c, loo, seed, sizes, length, contiguous):
    batch = random_batch(seed, sizes, length, contiguous=contiguous)
    batch["energy"] = torch.full_like(batch["energy"], c)
    res = run("otb", batch, align="generated", leave_one_out=loo, zero_tail=False)
    ones = dict(batch, energy=torch.ones_like(batch["energy"]))
    # With equal energies the k-th generated tokens of all rows have equal W: the plain mean.
    mask, g = batch["mask"], returns_ref(batch["rewards"], batch["mask"])
    k = mask.cumsum(1) - 1
    for i in range(mask.shape[0]):
        peers = (batch["group_ids"] == batch["group_ids"][i]).nonzero().flatten().tolist()
        peers = [j for j in peers if mask[j].any()]  # rows without a policy token are no members
        for t in range(length):
            if not mask[i, t]:
                continue
            pool = [
                (j, s)
                for j in peers
                if not (loo and j == i)
                for s in range(length)
                if mask[j, s] and k[j, s] == k[i, t]
            ]
            expected = sum(float(g[j, s]) for j, s in pool) / len(pool) if pool else 0.0
            if not loo and len(peers) == 1:
                expected = 0.0
            assert res.baselines[i, t].item() == pytest.approx(expected, abs=1e-5)
    # Scale invariance: any constant gives the same baselines as 1.
    torch.testing.assert_close(
        res.baselines, run("otb", ones, align="generated", leave_one_out=loo, zero_tail=False).baselines
    )


@settings(max_examples=60, deadline=None)
@given(scale=st.floats(1e-2, 1e2), **batch_params)
def test_otb_is_invariant_to_energy_scale(scale, seed, sizes, length, contiguous):
    batch = random_batch(seed, sizes, length, contiguous=contiguous)
    scaled = dict(batch, energy=batch["energy"] * scale)
    torch.testing.assert_close(
        run("otb", batch).advantages, run("otb", scaled).advantages, rtol=1e-5, atol=1e-5
    )


@settings(max_examples=60, deadline=None)
@given(name=estimator_names, **batch_params)
def test_groups_of_one_get_no_baseline(name, seed, sizes, length, contiguous):
    batch = random_batch(seed, [1] * len(sizes), length, contiguous=contiguous)
    res = run(name, batch)
    assert (res.baselines == 0).all()
    if name != "reinforce_pp_baseline":  # it whitens over the batch after the (absent) baseline
        torch.testing.assert_close(res.advantages, res.returns, rtol=2e-6, atol=1e-6)


@settings(max_examples=60, deadline=None)
@given(
    loo=st.booleans(),
    zero_tail=st.booleans(),
    seed=batch_params["seed"],
    sizes=batch_params["sizes"],
    length=batch_params["length"],
)
def test_generated_alignment_equals_position_alignment_on_contiguous_masks(
    loo, zero_tail, seed, sizes, length
):
    batch = random_batch(seed, sizes, length, contiguous=True)
    opts = dict(leave_one_out=loo, zero_tail=zero_tail)
    a = run("otb", batch, align="position", **opts)
    b = run("otb", batch, align="generated", **opts)
    torch.testing.assert_close(a.advantages, b.advantages)


@settings(max_examples=60, deadline=None)
@given(**batch_params)
def test_self_inclusive_baseline_is_a_convex_combination(seed, sizes, length, contiguous):
    batch = random_batch(seed, sizes, length, contiguous=contiguous)
    batch["energy"] = (
        batch["energy"] * torch.rand(1, generator=torch.Generator().manual_seed(seed)).item() ** 8
    )
    res = run("otb", batch, align="generated", zero_tail=False)
    g = returns_ref(batch["rewards"], batch["mask"])
    mask = batch["mask"].bool()
    for gid in batch["group_ids"].unique():
        rows = batch["group_ids"] == gid
        if mask[rows].any(dim=1).sum() < 2:  # fewer than two member rows: no baseline at all
            continue
        lo, hi = g[rows][mask[rows]].min(), g[rows][mask[rows]].max()
        vals = res.baselines.double()[rows][mask[rows]]
        assert (vals >= lo - 1e-5).all() and (vals <= hi + 1e-5).all()


# ----------------------------------------------------------------------------------------------------
# Edge cases.


def test_empty_responses_and_all_masked_batch():
    mask = torch.zeros(4, 5)
    for name in otbrl.ESTIMATORS:
        res = otbrl.compute_advantages(
            name,
            rewards=torch.tensor([1.0, 0, 1, 0]),
            mask=mask,
            group_ids=[0, 0, 1, 1],
            energy=torch.ones(4, 5),
        )
        assert (res.advantages == 0).all() and (res.returns == 0).all()
    empty = otbrl.compute_advantages(
        "otb",
        rewards=torch.zeros(0),
        mask=torch.zeros(0, 3),
        group_ids=torch.zeros(0, dtype=torch.long),
        energy=torch.zeros(0, 3),
    )
    assert empty.advantages.shape == (0, 3)


def test_empty_response_is_no_group_member():
    # Issue 15 item 5 (changed rule): a row without a policy token is no member of its group, so the
    # remaining row is a group of one and gets no baseline (it used to get 1 - 0.5).
    mask = torch.tensor([[1, 1], [0, 0]])
    res = otbrl.compute_advantages("dr_grpo", rewards=torch.tensor([1.0, 0.0]), mask=mask, group_ids=[0, 0])
    assert res.advantages[0].tolist() == [1.0, 1.0]


def test_zero_energy_falls_back_to_mean_without_nan():
    mask = torch.ones(3, 4)
    res = otbrl.compute_advantages(
        "otb", rewards=torch.tensor([1.0, 0.0, 0.0]), mask=mask, group_ids=[0, 0, 0], energy=torch.zeros(3, 4)
    )
    torch.testing.assert_close(res.baselines, torch.full((3, 4), 1 / 3))
    tiny = torch.rand(3, 4, generator=torch.Generator().manual_seed(0)) * 1e-30
    res = otbrl.compute_advantages(
        "otb", rewards=torch.tensor([1.0, 0.0, 0.0]), mask=mask, group_ids=[0, 0, 0], energy=tiny
    )
    assert ((res.baselines >= 0) & (res.baselines <= 1)).all()  # never the ~18 of a noisy ratio


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_low_precision_inputs_give_float32_outputs(dtype):
    batch = random_batch(0, [4, 4], 6)
    low = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in batch.items()}
    res = run("otb", low)
    ref = run("otb", {k: (v.to(dtype).double() if v.is_floating_point() else v) for k, v in batch.items()})
    assert res.advantages.dtype == torch.float32
    torch.testing.assert_close(res.advantages, ref.advantages)


def test_huge_rewards_and_energies_stay_finite():
    batch = random_batch(1, [4, 4], 6, allow_empty=False)
    batch["rewards"] = batch["rewards"] * 1e30
    batch["energy"] = batch["energy"] * 1e30
    res = run("otb", batch)
    assert torch.isfinite(res.advantages).all()


@pytest.mark.parametrize(
    "ids",
    [
        torch.tensor([5, 5, 9, 9, 5]),
        np.array(["a", "a", "b", "b", "a"]),
        np.array(["a", "a", "b", "b", "a"], dtype=object),
        ["a", "a", "b", "b", "a"],
        [("p", 1), ("p", 1), ("q", 2), ("q", 2), ("p", 1)],
        np.array([3, 3, 1, 1, 3]),
    ],
)
def test_group_id_types_are_equivalent(ids):
    batch = random_batch(2, [3, 2], 5)
    ref = run("otb", dict(batch, group_ids=torch.tensor([0, 0, 0, 1, 1])[[0, 1, 3, 4, 2]]))
    batch["group_ids"] = ids
    torch.testing.assert_close(run("otb", batch).advantages, ref.advantages)


def test_register_estimator_extension_point():
    name = "test_zero_baseline"
    if name not in otbrl.ESTIMATORS:

        @otbrl.register_estimator(name)
        def zero(batch, *, scale: float = 1.0):
            return batch.returns * scale, torch.zeros_like(batch.returns)

    res = otbrl.compute_advantages(
        name, rewards=torch.tensor([2.0]), mask=torch.ones(1, 2), group_ids=[0], scale=3.0
    )
    assert res.advantages.tolist() == [[6.0, 6.0]]
    with pytest.raises(ValueError, match="already registered"):
        otbrl.register_estimator(name)(lambda batch: None)


# ----------------------------------------------------------------------------------------------------
# Bad input: a ValueError that names the argument.

GOOD = dict(
    rewards=torch.tensor([1.0, 0.0]), mask=torch.ones(2, 3), group_ids=[0, 0], energy=torch.ones(2, 3)
)


@pytest.mark.parametrize(
    ("change", "estimator", "options", "match"),
    [
        ({}, "nope", {}, r"estimator: unknown .*known: .*dr_grpo.*otb"),
        ({"energy": None}, "otb", {}, r"energy: estimator 'otb' needs"),
        ({"energy": None}, "sob", {}, r"energy:"),
        ({"rewards": torch.tensor([1.0, 0.0, 1.0])}, "otb", {}, r"rewards: length 3"),
        ({"rewards": torch.ones(2, 4)}, "otb", {}, r"rewards: expected shape"),
        ({"rewards": torch.tensor([float("nan"), 0.0])}, "grpo", {}, r"rewards: contains NaN"),
        (
            {"rewards": torch.tensor([[0.0, 0, 0], [0, 0, 1]]), "mask": torch.tensor([[1, 1, 1], [1, 1, 0]])},
            "otb",
            {},
            r"rewards: 1 nonzero token reward.*row 1, position 2",
        ),
        ({"mask": torch.full((2, 3), 2.0)}, "otb", {}, r"mask: values must be 0 or 1"),
        ({"mask": torch.ones(2, 3, 1)}, "otb", {}, r"mask: expected shape \(B, T\)"),
        ({"group_ids": [0, 0, 1]}, "otb", {}, r"group_ids: length 3"),
        ({"group_ids": torch.tensor([0.0, 0.0])}, "otb", {}, r"group_ids: expected a 1-D integer"),
        ({"group_ids": [[0], [1]]}, "otb", {}, r"group_ids: every id must be hashable"),
        ({"energy": torch.ones(2, 4)}, "otb", {}, r"energy: shape"),
        (
            {"energy": torch.tensor([[1.0, float("inf"), 1], [1, 1, 1]])},
            "otb",
            {},
            r"energy: contains NaN or inf",
        ),
        (
            {"energy": torch.tensor([[1.0, -1e-4, 1], [1, 1, 1]])},
            "otb",
            {},
            r"energy: must be >= 0.*token_energy_from_logprobs",
        ),
        ({}, "otb", {"align": "turn"}, r"align: expected one of"),
        ({}, "otb", {"eps": 0.0}, r"eps: must be"),
        ({}, "otb", {"is_weights": -torch.ones(2, 3)}, r"is_weights: must be >= 0"),
        ({}, "otb", {"is_weights": torch.ones(3)}, r"is_weights: shape"),
        (
            {},
            "otb",
            {"leave_one_ot": True},
            r"leave_one_ot: not an option of estimator 'otb' \(its options: leave_one_out",
        ),
        ({}, "grpo", {"align": "position"}, r"align: not an option of estimator 'grpo'"),
    ],
)
def test_bad_input_names_the_argument(change, estimator, options, match):
    with pytest.raises(ValueError, match=match):
        otbrl.compute_advantages(estimator, **{**GOOD, **change}, **options)


def test_values_at_masked_positions_are_never_read():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    energy = torch.tensor([[1.0, 1.0, float("nan")], [1.0, -5.0, float("inf")]])
    res = otbrl.compute_advantages(
        "otb", rewards=torch.tensor([1.0, 0.0]), mask=mask, group_ids=[0, 0], energy=energy
    )
    assert torch.isfinite(res.advantages).all()


def test_leave_one_out_survives_one_trajectory_holding_almost_all_energy():
    # Others' energy is 1e-7 of the dominant trajectory's: total - own would cancel in float32.
    mask = torch.ones(3, 4)
    energy = torch.tensor([[1.9] * 4, [1e-7] * 4, [3e-7] * 4], dtype=torch.float32)
    rewards = torch.tensor([5.0, 1.0, 0.0])
    res = otbrl.compute_advantages(
        "otb", rewards=rewards, mask=mask, group_ids=[0, 0, 0], energy=energy, leave_one_out=True
    )
    _, base = otb_ref(
        rewards.double(), mask.double(), torch.tensor([0, 0, 0]), energy.double(), leave_one_out=True
    )
    torch.testing.assert_close(res.baselines.double(), base, rtol=1e-5, atol=1e-6)
    assert res.baselines[0, 0].item() == pytest.approx(0.25, rel=1e-5)  # (1 * 1 + 0 * 3) / 4


def test_unmasked_output_of_a_custom_estimator_is_masked():
    name = "test_unmasked"
    if name not in otbrl.ESTIMATORS:

        @otbrl.register_estimator(name)
        def unmasked(batch):
            return torch.ones(batch.mask.shape), torch.ones(batch.mask.shape)

    res = otbrl.compute_advantages(
        name, rewards=torch.zeros(2), mask=torch.tensor([[1, 0], [0, 0]]), group_ids=[0, 1]
    )
    assert res.advantages.tolist() == [[1.0, 0.0], [0.0, 0.0]]
    assert res.baselines.tolist() == [[1.0, 0.0], [0.0, 0.0]]

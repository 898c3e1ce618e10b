"""Group membership, decided once in otbrl.inputs.Rollouts: a row with no policy token (mask all zero,
e.g. a row a trainer could not score and masked out) is a member of no group, for every estimator.
Float64 loop references (tests/references.py, which skip such rows) and laws that need no reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import otbrl
from otbrl.inputs import make_rollouts
from tests.references import otb_ref, random_batch, returns_ref, sequence_ref

SEQUENCE_ESTIMATORS = ["grpo", "dr_grpo", "rloo", "opo", "sob", "reinforce_pp_baseline"]
OTB_OPTIONS = [
    {},
    {"zero_tail": False},
    {"leave_one_out": True},
    {"align": "generated"},
    {"align": "generated", "zero_tail": False},
]
NAMES = ["grpo", "dr_grpo", "rloo", "opo", "sob", "reinforce_pp_baseline", "otb"]


def run(name: str, batch: dict, **options) -> otbrl.AdvantageResult:
    return otbrl.compute_advantages(name, **batch, **options)


def batch_with_empty_rows(seed: int, token_rewards: bool = False, contiguous: bool = True) -> dict:
    """Five groups: 4 rows with one empty; 3 rows all empty; 2 rows with one empty (a lone member);
    3 rows with two empty (a lone member); 3 full rows. Empty rows carry nonzero outcome rewards, which
    must not leak into any group statistic."""
    sizes = [4, 3, 2, 3, 3]
    batch = random_batch(
        seed, sizes, 6, contiguous=contiguous, token_rewards=token_rewards, allow_empty=False
    )
    empty = [1, 4, 5, 6, 8, 10, 11]
    batch["mask"][empty] = 0.0
    if token_rewards:
        batch["rewards"] = batch["rewards"] * batch["mask"]
    else:
        batch["rewards"][empty] = 5.0
    return batch


def test_dr_grpo_ignores_an_empty_row_in_the_group():
    # The case of issue 15 item 5: rewards [1, ., 1, 0] with row 1 unscored and masked out.
    mask = torch.tensor([[1, 1], [0, 0], [1, 0], [1, 1]])
    res = otbrl.compute_advantages(
        "dr_grpo", rewards=torch.tensor([1.0, 7.0, 1.0, 0.0]), mask=mask, group_ids=[0, 0, 0, 0]
    )
    expected = torch.tensor([[1 / 3, 1 / 3], [0, 0], [1 / 3, 0], [-2 / 3, -2 / 3]])
    torch.testing.assert_close(res.advantages, expected)


def test_grpo_and_rloo_hand_computed():
    mask = torch.tensor([[1.0], [0.0], [1.0], [1.0]])
    kw = dict(rewards=torch.tensor([1.0, -9.0, 1.0, 0.0]), mask=mask, group_ids=[3, 3, 3, 3])
    rloo = otbrl.compute_advantages("rloo", **kw).advantages[:, 0]
    torch.testing.assert_close(rloo, torch.tensor([0.5, 0.0, 0.5, -1.0]))
    std = (((1 / 3) ** 2 * 2 + (2 / 3) ** 2) / 2) ** 0.5  # unbiased, over the 3 members
    grpo = otbrl.compute_advantages("grpo", **kw).advantages[:, 0].double()
    expected = torch.tensor([1 / 3, 0.0, 1 / 3, -2 / 3], dtype=torch.float64) / (std + 1e-6)
    torch.testing.assert_close(grpo, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", SEQUENCE_ESTIMATORS)
@pytest.mark.parametrize("token_rewards", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_sequence_estimators_with_empty_rows_match_reference(name, token_rewards, seed):
    batch = batch_with_empty_rows(seed, token_rewards)
    res = run(name, batch)
    eps = 1e-6 if name == "grpo" else 1e-8
    ref = sequence_ref(name, batch["rewards"], batch["mask"], batch["group_ids"], batch["energy"], eps=eps)
    torch.testing.assert_close(res.advantages.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("options", OTB_OPTIONS)
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("seed", range(3))
def test_otb_with_empty_rows_matches_reference(options, contiguous, seed):
    batch = batch_with_empty_rows(seed, contiguous=contiguous)
    res = run("otb", batch, **options)
    adv, base = otb_ref(**batch, **options)
    torch.testing.assert_close(res.advantages.double(), adv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(res.baselines.double(), base, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_lone_member_gets_no_baseline(name):
    # Groups 2 and 3 keep one member each (rows 7 and 9): A = G, whatever the empty rows hold.
    batch = batch_with_empty_rows(0)
    options = [{}] if name != "otb" else OTB_OPTIONS
    g = returns_ref(batch["rewards"], batch["mask"])
    for opts in options:
        res = run(name, batch, **opts)
        for row in (7, 9):
            assert (res.baselines[row] == 0).all()
            if name == "grpo":  # (R - 0) / (1 + eps)
                torch.testing.assert_close(res.advantages[row].double(), g[row] / (1 + 1e-6))
            elif name != "reinforce_pp_baseline":  # that one whitens over the batch afterwards
                torch.testing.assert_close(res.advantages[row].double(), g[row])


@pytest.mark.parametrize("name", NAMES)
def test_all_empty_group_and_empty_rows_get_zeros(name):
    batch = batch_with_empty_rows(1)
    res = run(name, batch)
    assert torch.isfinite(res.advantages).all()
    empty = batch["mask"].sum(dim=1) == 0
    assert (res.advantages[empty] == 0).all() and (res.baselines[empty] == 0).all()


def test_rollouts_count_member_rows_only():
    batch = batch_with_empty_rows(2)
    rollouts = make_rollouts(**batch)
    assert rollouts.group_counts.tolist() == [3, 0, 1, 1, 3]
    assert rollouts.members.tolist() == [row not in (1, 4, 5, 6, 8, 10, 11) for row in range(15)]


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(NAMES),
    loo=st.booleans(),
    zero_tail=st.booleans(),
    seed=st.integers(0, 10_000),
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    inserted=st.lists(st.tuples(st.integers(0, 20), st.floats(-5, 5)), min_size=1, max_size=4),
    contiguous=st.booleans(),
)
def test_inserting_empty_rows_changes_nothing_else(name, loo, zero_tail, seed, sizes, inserted, contiguous):
    """A law without a reference: an empty row (any reward) added to any group leaves every other
    row's advantages and baselines exactly as they were."""
    batch = random_batch(seed, sizes, 5, contiguous=contiguous, allow_empty=False)
    rows = batch["mask"].shape[0]
    n_groups = len(sizes)
    mask, rewards, groups = list(batch["mask"]), list(batch["rewards"]), list(batch["group_ids"])
    energy = list(batch["energy"])
    for where, reward in inserted:
        at = where % (len(mask) + 1)
        mask.insert(at, torch.zeros(5, dtype=torch.float64))
        rewards.insert(at, torch.tensor(reward, dtype=torch.float64))
        groups.insert(at, torch.tensor(where % n_groups))
        energy.insert(at, torch.full((5,), 3.0, dtype=torch.float64))
    padded = {
        "mask": torch.stack(mask),
        "rewards": torch.stack(rewards),
        "group_ids": torch.stack(groups),
        "energy": torch.stack(energy),
    }
    kept = padded["mask"].sum(dim=1) > 0
    assert int(kept.sum()) == rows
    options = {"leave_one_out": loo, "zero_tail": zero_tail} if name == "otb" else {}
    plain, with_empty = run(name, batch, **options), run(name, padded, **options)
    torch.testing.assert_close(with_empty.advantages[kept], plain.advantages, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(with_empty.baselines[kept], plain.baselines, rtol=1e-6, atol=1e-6)

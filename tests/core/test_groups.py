"""otbrl.groups: dense group indices, per-group sums (block fast path and general path), alignment."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from otbrl.groups import aligned_columns, dense_group_index, from_frame, group_sums, to_frame


def sums_ref(values: torch.Tensor, group: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.zeros((n, *values.shape[1:]), dtype=torch.float64)
    for i, g in enumerate(group.tolist()):
        out[g] += values[i].double()
    return out


@pytest.mark.parametrize(
    "group",
    [
        [0, 0, 1, 1, 2, 2],  # consecutive equal blocks in order: the fast path
        [2, 2, 0, 0, 1, 1],  # consecutive blocks out of order: fast path plus reordering
        [0, 1, 0, 1, 2, 2],  # interleaved: general path
        [0, 0, 0, 1, 1, 2],  # unequal sizes: general path
        [0, 0, 1, 1, 0, 0],  # equal-size blocks but a group split in two: must not take the fast path
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bool])
def test_group_sums_equal_reference(group, dtype):
    group = torch.tensor(group)
    n = int(group.max()) + 1
    values = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))
    values = values > 0 if dtype == torch.bool else values.to(dtype)
    got = group_sums(values, group, n)
    torch.testing.assert_close(got.double(), sums_ref(values, group, n))
    # along another dimension
    got_t = group_sums(values.t().contiguous(), group, n, dim=1)
    torch.testing.assert_close(got_t.double().t(), sums_ref(values, group, n))


def test_dense_group_index_forms():
    expected = [0, 0, 1, 1, 0]
    for ids in (
        torch.tensor([4, 4, 9, 9, 4]),
        np.array(["x", "x", "y", "y", "x"]),
        ["x", "x", "y", "y", "x"],
    ):
        index, n = dense_group_index(ids, 5)
        assert n == 2
        # same partition, whatever the numbering
        assert [index[i] == index[j] for i in range(5) for j in range(5)] == [
            expected[i] == expected[j] for i in range(5) for j in range(5)
        ]
    with pytest.raises(ValueError, match="group_ids: expected a tensor"):
        dense_group_index("abc", 3)
    with pytest.raises(ValueError, match="group_ids: expected a 1-D array"):
        dense_group_index(np.zeros((2, 2)), 2)


def test_generated_alignment_counts_policy_tokens():
    mask = torch.tensor([[1, 1, 0, 0, 1], [0, 1, 0, 1, 1]]).bool()
    cols, width = aligned_columns(mask, "generated")
    assert width == 6
    assert cols.tolist() == [[0, 1, 5, 5, 2], [5, 0, 5, 1, 2]]
    cols, width = aligned_columns(mask, "position")
    assert width == 5 and cols.tolist() == [[0, 1, 2, 3, 4]] * 2
    with pytest.raises(ValueError, match="align"):
        aligned_columns(mask, "turn")


def test_frame_roundtrip():
    mask = torch.tensor([[1, 1, 0, 0, 1], [0, 1, 0, 1, 1]]).bool()
    values = torch.arange(1.0, 11.0).view(2, 5) * mask
    cols, width = aligned_columns(mask, "generated")
    framed = to_frame(values, cols, width)
    assert framed[:, :3].tolist() == [[1.0, 2.0, 5.0], [7.0, 9.0, 10.0]]
    assert torch.equal(from_frame(framed, cols) * mask, values)


def test_rows_of_matches_indexing_for_every_layout():
    from otbrl.groups import rows_of

    gen = torch.Generator().manual_seed(0)
    table = torch.randn(3, 5, generator=gen)
    scale = torch.rand(6, 5, generator=gen)
    for group in ([0, 0, 1, 1, 2, 2], [2, 2, 0, 0, 1, 1], [0, 1, 2, 0, 1, 2]):
        group = torch.tensor(group)
        expected = torch.stack([table[g] * scale[b] for b, g in enumerate(group.tolist())])
        torch.testing.assert_close(rows_of(table, group, 3, scale), expected)

"""Group bookkeeping for per-prompt baselines, without Python loops over rows or groups.

Prompt ids become dense indices; per-token values are summed per (group, aligned column) with one
`index_add_`, where a column is either the absolute response position or the k-th policy token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

ALIGNMENTS = ("position", "generated")


def dense_group_index(
    group_ids: Any, batch_size: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, int]:
    """Map prompt identities to dense indices 0..G-1.

    group_ids: (B,) integer tensor, numpy array (numbers or strings, as verl's uid arrays) or any sequence
    of hashables. Returns (index (B,) long on `device`, G). Equal ids share an index; order is irrelevant.
    """
    if isinstance(group_ids, torch.Tensor):
        if group_ids.dim() != 1 or group_ids.is_floating_point() or group_ids.is_complex():
            raise ValueError(
                f"group_ids: expected a 1-D integer tensor, got {group_ids.dtype} {tuple(group_ids.shape)}"
            )
        ids, index = torch.unique(group_ids, return_inverse=True)
        size = group_ids.shape[0]
    elif isinstance(group_ids, np.ndarray) and group_ids.dtype != object:
        if group_ids.ndim != 1:
            raise ValueError(f"group_ids: expected a 1-D array, got shape {group_ids.shape}")
        ids, inverse = np.unique(group_ids, return_inverse=True)
        index, size = torch.from_numpy(inverse.reshape(-1).astype(np.int64)), group_ids.shape[0]
    elif isinstance(group_ids, (Sequence, np.ndarray)) and not isinstance(group_ids, (str, bytes)):
        seen: dict[Any, int] = {}
        try:
            index = torch.tensor([seen.setdefault(g, len(seen)) for g in group_ids], dtype=torch.long)
        except TypeError as err:
            raise ValueError(f"group_ids: every id must be hashable ({err})") from None
        ids, size = seen, len(group_ids)
    else:
        raise ValueError(
            f"group_ids: expected a tensor, array or sequence of ids, got {type(group_ids).__name__}"
        )
    if size != batch_size:
        raise ValueError(f"group_ids: length {size} does not match the batch size {batch_size}")
    return index.to(device=device, dtype=torch.long), len(ids)


def aligned_columns(mask: torch.Tensor, align: str) -> tuple[torch.Tensor, int]:
    """Column of every token in the frame where trajectories of a group are compared.

    mask: (B, T) bool. "position": column t (absolute response position). "generated": the k-th policy
    token of its row gets column k - 1, so tool tokens between turns do not shift the alignment.
    Returns (columns (B, T) long, width); tokens with mask == 0 point to the spare column `width - 1`
    in "generated" mode, which no policy token uses.
    """
    if align not in ALIGNMENTS:
        raise ValueError(f"align: expected one of {ALIGNMENTS}, got {align!r}")
    rows, length = mask.shape
    if align == "position":
        return torch.arange(length, device=mask.device).expand(rows, length), length
    rank = mask.long().cumsum(dim=-1) - 1
    return torch.where(mask, rank, length), length + 1


def _block_size(group: torch.Tensor, n_groups: int) -> int:
    """N if rows come as n_groups consecutive blocks of N rows, one block per group (the layout
    trainers produce by repeating each prompt N times); else 0."""
    rows = group.shape[0]
    if n_groups == 0 or rows % n_groups:
        return 0
    n = rows // n_groups
    blocks = group.view(n_groups, n)
    if not (blocks == blocks[:, :1]).all():
        return 0
    return n if torch.unique(blocks[:, 0]).numel() == n_groups else 0


def group_sums(values: torch.Tensor, group: torch.Tensor, n_groups: int, dim: int = 0) -> torch.Tensor:
    """Sum the entries that share a group along `dim`: size B there becomes G (bool sums to int64)."""
    dim = dim % values.dim()
    n = _block_size(group, n_groups)
    if n:  # one pass of reduction instead of a scattered add
        blocks = values.unflatten(dim, (n_groups, n)).sum(dim=dim + 1)
        order = group[::n]
        if bool((order == torch.arange(n_groups, device=order.device)).all()):
            return blocks
        return torch.empty_like(blocks).index_copy_(dim, order, blocks)
    if values.dtype == torch.bool:  # counting: index_add needs numbers
        values = values.to(torch.int64)
    shape = list(values.shape)
    shape[dim] = n_groups
    return values.new_zeros(shape).index_add_(dim, group, values)


def to_frame(values: torch.Tensor, columns: torch.Tensor, width: int) -> torch.Tensor:
    """Move each row's tokens to their aligned columns: (..., B, T) -> (..., B, width).

    Masked tokens must hold zeros: in "generated" mode they all land in the spare column, which is
    summed and never read back.
    """
    if width == values.shape[-1]:  # position alignment: the frame is the tensor itself
        return values
    out = values.new_zeros((*values.shape[:-1], width))
    return out.scatter_add_(-1, columns.expand_as(values), values)


def from_frame(framed: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """Read each token's value back from its aligned column: (..., B, width) -> (..., B, T)."""
    if framed.shape[-1] == columns.shape[-1]:
        return framed
    return framed.gather(-1, columns.expand((*framed.shape[:-1], columns.shape[-1])))


def rows_of(
    table: torch.Tensor,
    group: torch.Tensor,
    n_groups: int,
    scale: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each row's line of a per-group table, times `scale`: (G, W), (B,), (B, W) -> (B, W).

    With rows in consecutive, ordered blocks per group (the usual trainer layout) this is one
    broadcasting multiply, with no (B, W) copy of the table in between. `out`: an optional contiguous
    (B, W) tensor to write into (not `scale` itself).
    """
    n = _block_size(group, n_groups)
    if n and bool((group[::n] == torch.arange(n_groups, device=group.device)).all()):
        width = table.shape[-1]
        blocks = scale.reshape(n_groups, n, width)
        if out is None:
            return (table[:, None, :] * blocks).reshape(scale.shape)  # any strides (a transposed mask)
        torch.mul(table[:, None, :], blocks, out=out.view(n_groups, n, width))
        return out
    rows = table.index_select(0, group) if out is None else torch.index_select(table, 0, group, out=out)
    return rows.mul_(scale)

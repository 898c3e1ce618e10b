"""Plain float64 loop references for the estimators and for the energy of completion tokens, written
independently of otbrl (never imported from it), plus a random-batch generator shared by the estimator
tests."""

from __future__ import annotations

import math

import torch


def random_batch(
    seed: int,
    group_sizes: list[int],
    length: int,
    *,
    contiguous: bool = True,
    token_rewards: bool = False,
    allow_empty: bool = True,
) -> dict:
    """A batch of rows grouped as `group_sizes`, response length `length`.

    contiguous: left-aligned masks (single-turn); otherwise random gaps (multi-turn tool tokens).
    Returns plain tensors: rewards, mask (float 0/1), group_ids, energy (with garbage where masked).
    """
    g = torch.Generator().manual_seed(seed)
    rows = sum(group_sizes)
    group_ids = torch.repeat_interleave(torch.arange(len(group_sizes)), torch.tensor(group_sizes))
    low = 0 if allow_empty else 1
    lengths = torch.randint(low, length + 1, (rows,), generator=g)
    if contiguous:
        mask = (torch.arange(length)[None, :] < lengths[:, None]).double()
    else:
        mask = (torch.rand(rows, length, generator=g) < 0.6).double()
        if not allow_empty:
            mask[:, 0] = 1.0
    energy = torch.rand(rows, length, generator=g, dtype=torch.float64) * 1.5
    energy = torch.where(mask.bool(), energy, torch.full_like(energy, 7.0))  # garbage where masked
    if token_rewards:
        rewards = torch.randn(rows, length, generator=g, dtype=torch.float64) * mask
    else:
        rewards = torch.randint(0, 2, (rows,), generator=g).double() + 0.25 * torch.randn(
            rows, generator=g, dtype=torch.float64
        )
    return {"rewards": rewards, "mask": mask, "group_ids": group_ids, "energy": energy}


def returns_ref(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    rows, length = mask.shape
    tok = torch.zeros(rows, length, dtype=torch.float64)
    for i in range(rows):
        if rewards.dim() == 2:
            tok[i] = rewards[i]
        else:
            policy = [t for t in range(length) if mask[i, t]]
            if policy:
                tok[i, policy[-1]] = rewards[i]
    out = torch.zeros(rows, length, dtype=torch.float64)
    for i in range(rows):
        acc = 0.0
        for t in reversed(range(length)):
            acc += float(tok[i, t]) * float(mask[i, t])
            out[i, t] = acc if mask[i, t] else 0.0
    return out


def _groups(group_ids, mask=None) -> dict:
    """group id -> member rows; with `mask`, rows without a policy token are members of no group."""
    members: dict = {}
    for i, gid in enumerate(group_ids):
        if mask is None or any(float(m) != 0 for m in mask[i]):
            members.setdefault(int(gid), []).append(i)
    return members


def outcome_ref(rewards: torch.Tensor, mask: torch.Tensor) -> list[float]:
    if rewards.dim() == 1:
        return [float(x) for x in rewards]
    return [float((rewards[i] * mask[i]).sum()) for i in range(mask.shape[0])]


def sequence_ref(name: str, rewards, mask, group_ids, energy=None, eps: float = 1e-6) -> torch.Tensor:
    """Advantages of the sequence-level estimators, broadcast over policy tokens."""
    r = outcome_ref(rewards, mask)
    rows = mask.shape[0]
    adv = [0.0] * rows
    for idx in _groups(group_ids, mask).values():
        n = len(idx)
        for i in idx:
            others = [r[j] for j in idx if j != i]
            mean = sum(r[j] for j in idx) / n
            if n == 1:
                base, scale = 0.0, 1.0
            elif name in ("grpo",):
                var = sum((r[j] - mean) ** 2 for j in idx) / (n - 1)
                base, scale = mean, math.sqrt(var) + eps
            elif name in ("dr_grpo", "reinforce_pp_baseline"):
                base, scale = mean, 1.0
            elif name == "rloo":
                base, scale = sum(others) / (n - 1), 1.0
            elif name in ("opo", "sob"):
                if name == "opo":
                    wts = [float(mask[j].sum()) for j in idx]
                else:
                    wts = [float((energy[j] * mask[j]).sum()) for j in idx]
                den = sum(wts)
                base = sum(wt * r[j] for wt, j in zip(wts, idx, strict=True)) / den if den > 1e-8 else mean
                scale = 1.0
            else:
                raise KeyError(name)
            adv[i] = (r[i] - base) / scale
    out = torch.tensor(adv, dtype=torch.float64)[:, None] * mask
    if name == "reinforce_pp_baseline":
        vals = [float(out[i, t]) for i in range(rows) for t in range(mask.shape[1]) if mask[i, t]]
        if vals:
            mu = sum(vals) / len(vals)
            var = sum((v - mu) ** 2 for v in vals) / max(len(vals) - 1, 1)
            out = (out - mu) / math.sqrt(var + 1e-8) * mask
    return out


def otb_ref(
    rewards,
    mask,
    group_ids,
    energy,
    *,
    leave_one_out: bool = False,
    align: str = "position",
    zero_tail: bool = True,
    is_weights=None,
    eps: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OTB exactly as otbrl documents it, token by token: returns (advantages, baselines)."""
    rows, length = mask.shape
    g = returns_ref(rewards, mask)
    big_w = torch.zeros(rows, length, dtype=torch.float64)
    col = [[-1] * length for _ in range(rows)]
    for i in range(rows):
        acc, k = 0.0, 0
        for t in range(length):
            if mask[i, t]:
                rho = 1.0 if is_weights is None else float(is_weights[i, t])
                acc += float(energy[i, t]) * rho * rho
                col[i][t] = t if align == "position" else k
                k += 1
            big_w[i, t] = acc
    adv = torch.zeros(rows, length, dtype=torch.float64)
    base = torch.zeros(rows, length, dtype=torch.float64)
    for idx in _groups(group_ids, mask).values():
        at = {}  # column -> list of (row, t) active there
        for i in idx:
            for t in range(length):
                if mask[i, t]:
                    at.setdefault(col[i][t], []).append((i, t))
        for i in idx:
            for t in range(length):
                if not mask[i, t]:
                    continue
                peers = at[col[i][t]]
                pool = [(j, s) for j, s in peers if j != i] if leave_one_out else peers
                num = sum(float(g[j, s]) * float(big_w[j, s]) for j, s in pool)
                den = sum(float(big_w[j, s]) for j, s in pool)
                if den > eps:
                    b = num / den
                elif pool:
                    b = sum(float(g[j, s]) for j, s in pool) / len(pool)
                else:
                    b = 0.0
                if not leave_one_out and (len(idx) == 1 or (zero_tail and len(peers) == 1)):
                    b = 0.0
                base[i, t] = b
                adv[i, t] = float(g[i, t]) - b
    return adv, base


def authors_otb_ref(rewards, mask, group_ids, energy, *, multi_turn: bool, eps: float = 1e-8) -> torch.Tensor:
    """The authors' reference semantics (handle_zero_tail on), restated as loops.

    Single-turn: positions are absolute; a group's baseline at position t is
    sum G W m / (sum W m + eps) over all its rows; groups of one get 0; a uniquely longest row
    (length = mask sum) gets baseline 0 from the second-longest length on.
    Multi-turn: each row's policy tokens are compacted to the left first (k-th generated token),
    rows without policy tokens are left out of their group, then the same rule applies.
    """
    rows, length = mask.shape
    g = returns_ref(rewards, mask)
    big_w = (energy * mask).cumsum(dim=-1)
    if multi_turn:
        keep = [[t for t in range(length) if mask[i, t]] for i in range(rows)]
        frame_len = max([len(k) for k in keep] + [0])
        fg = torch.zeros(rows, frame_len, dtype=torch.float64)
        fw = torch.zeros(rows, frame_len, dtype=torch.float64)
        fm = torch.zeros(rows, frame_len, dtype=torch.float64)
        for i in range(rows):
            for k, t in enumerate(keep[i]):
                fg[i, k], fw[i, k], fm[i, k] = g[i, t], big_w[i, t], 1.0
        groups = {}
        for i, gid in enumerate(group_ids):
            if fm[i].sum() > 0:
                groups.setdefault(int(gid), []).append(i)
    else:
        keep = [list(range(length)) for _ in range(rows)]
        fg, fw, fm = g, big_w, mask.double()
        groups = _groups(group_ids)
    base = torch.zeros_like(fg)
    for idx in groups.values():
        if len(idx) == 1:
            continue
        for c in range(fg.shape[1]):
            num = sum(float(fg[i, c] * fw[i, c] * fm[i, c]) for i in idx)
            den = sum(float(fw[i, c] * fm[i, c]) for i in idx) + eps
            for i in idx:
                base[i, c] = num / den
        lengths = sorted((float(fm[i].sum()), i) for i in idx)
        (second, _), (longest, who) = lengths[-2], lengths[-1]
        if longest > second:
            base[who, int(second) :] = 0.0
    adv = torch.zeros(rows, length, dtype=torch.float64)
    for i in range(rows):
        for k, t in enumerate(keep[i]):
            if mask[i, t]:
                adv[i, t] = fg[i, k] - base[i, k]
    return adv


def reference_energy(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """(B, T, V) logits, (B, T) tokens -> (B, T) float64 ||e_y - softmax(z / T)||^2, one token at a time."""
    out = torch.zeros(tokens.shape, dtype=torch.float64)
    for b in range(tokens.shape[0]):
        for t in range(tokens.shape[1]):
            z = logits[b, t].double() / temperature
            p = torch.exp(z - z.max())
            p = p / p.sum()
            onehot = torch.zeros_like(p)
            onehot[int(tokens[b, t])] = 1.0
            out[b, t] = ((onehot - p) ** 2).sum()
    return out


def model_reference(model, ids: torch.Tensor, attention: torch.Tensor, n: int, temperature: float):  # noqa: ANN001, ANN201
    """The energy of the last n tokens from the model's own full-sequence logits, float64."""
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits
    width = ids.shape[1]
    return reference_energy(logits[:, width - n - 1 : width - 1], ids[:, width - n :], temperature)

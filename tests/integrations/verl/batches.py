"""Random rollouts in verl's layout, shared by the verl estimator and trainer tests."""

from __future__ import annotations

import numpy as np
import torch


def verl_batch(seed: int, sizes: list[int], length: int, *, tool_tokens: bool, vocab: int = 37) -> dict:
    """Random rollouts in verl's layout: float32 token rewards on each row's last policy token, a uid
    string array, old log-probs and Σπ² of random logits (so 1 - 2 pi + Σπ² is a real energy)."""
    gen = torch.Generator().manual_seed(seed)
    rows = sum(sizes)
    lengths = torch.randint(1, length + 1, (rows,), generator=gen)
    lengths[0] = length  # a uniquely longest row exercises the zero-tail rule
    lengths[1:][lengths[1:] == length] = length - 1
    mask = torch.arange(length)[None, :] < lengths[:, None]
    if tool_tokens:  # holes inside the response: tool output between turns
        holes = torch.rand(rows, length, generator=gen) < 0.3
        holes[:, 0] = False
        mask &= ~holes
    last = torch.where(mask, torch.arange(length), -1).amax(dim=-1)
    rewards = torch.zeros(rows, length)
    rewards[torch.arange(rows), last] = torch.randint(0, 2, (rows,), generator=gen).float()
    logits = torch.randn(rows, length, vocab, generator=gen) * 3
    tokens = torch.randint(0, vocab, (rows, length), generator=gen)
    logprobs = logits.log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)
    uid = np.array([f"prompt-{g}" for g, n in enumerate(sizes) for _ in range(n)], dtype=object)
    return {
        "token_level_rewards": rewards,
        "response_mask": mask.float(),
        "index": uid,
        "old_log_probs": logprobs,
        "sum_pi_squared": logits.softmax(-1).square().sum(-1),
        "rollout_is_weights": torch.rand(rows, length, generator=gen) * 2,
    }

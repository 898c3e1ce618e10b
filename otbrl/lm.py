"""How a causal language model's outputs line up with the tokens they score: the output at position t
predicts token t + 1. Every place in otbrl that reads logits or hidden states for a completion goes
through `predicting`, so the shift is written once.
"""

from __future__ import annotations

import torch


def predicting(outputs: torch.Tensor, n: int) -> torch.Tensor:
    """(B, L, ...) per-position outputs (logits or hidden states) of a causal LM run over L tokens ->
    (B, n, ...): the outputs at the positions that predict the last n of those tokens."""
    length = outputs.shape[1]
    if not 0 <= n < length:
        raise ValueError(f"n: {n} tokens cannot be predicted from {length} positions (need 0 <= n < L)")
    return outputs[:, length - n - 1 : length - 1]

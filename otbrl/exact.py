"""Exact per-token squared score norms ||grad_theta log pi(y_t)||^2 for small torch models: the quantity
the Logit-Gradient Proxy approximates, and the `otb_exact` estimator built on it.

Cost: one forward pass per sequence plus one backward pass per policy token (vectorised with
torch.func.vmap in the default method), and memory for (policy tokens x parameters) gradients of one
sequence at a time. Fine for models of up to a few million parameters; a research reference, not a
training path.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.func import functional_call, jacrev

from otbrl.estimators import ESTIMATORS, otb, register_estimator
from otbrl.inputs import Rollouts, check_mask, check_temperature
from otbrl.lm import predicting

METHODS = ("vmap", "loop")


def _logits(model: torch.nn.Module, params: dict, ids: torch.Tensor) -> torch.Tensor:
    """(L,) token ids -> (1, L, V) logits."""
    out = functional_call(model, params, (ids[None],))
    return out.logits if hasattr(out, "logits") else out


def _left_padding(attention_mask: Any, input_ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """(B,) number of leading padding columns per row; raises unless padding is only on the left (or
    trailing), with no policy token on it."""
    if attention_mask is None:
        return torch.zeros(input_ids.shape[0], dtype=torch.long)
    real = check_mask(attention_mask).to(input_ids.device)
    if real.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask: shape {tuple(real.shape)} does not match input_ids {tuple(input_ids.shape)}"
        )
    # Left padding (0..0 1..1) has at most one rise from 0 to 1 and none if it starts real; so does
    # trailing padding, which a causal model never reads back. Holes inside a sequence have more.
    rises = (real[:, 1:] & ~real[:, :-1]).sum(dim=-1) + real[:, 0]
    if (rises > 1).any():
        raise ValueError("attention_mask: padding must sit at either end of a row, not inside it")
    if (keep & ~real[:, -keep.shape[1] :]).any():
        raise ValueError("mask: a policy token sits where attention_mask is 0 (padding)")
    return (real.cumsum(dim=-1) == 0).sum(dim=-1)


def score_sq_norms(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    temperature: float = 1.0,
    method: str = "vmap",
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact ||grad_theta log softmax(z_{t-1} / T)[x_t]||^2 for every policy token.

    model: maps (1, L) token ids to logits (1, L, V) (or an output with `.logits`), e.g. a transformers
        causal LM; trainable parameters are those with requires_grad.
    input_ids: (B, L) full sequences (prompt + response). mask: (B, T) with T <= L, aligned with the
        last T columns of input_ids; 1 marks policy tokens (never the first real token of a row).
    attention_mask: (B, L) 1 for real tokens, 0 for padding (None: no padding). Left padding is cut
        off each row before the model sees it, so the row starts at position 0: the same positions as
        the sampler's cumsum(attention_mask) - 1, for any model that numbers positions from 0. Padding
        inside a row, or policy tokens on padding, raise. Without it, padding would be read as text.
    method: "vmap" (torch.func.jacrev, fast) or "loop" (one autograd backward per token, for models
        that vmap cannot trace).
    The logits that score token t are those at t - 1 (`otbrl.lm.predicting`, the one shift rule).
    Returns (B, T) float64, zero where mask == 0.
    """
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    temperature = check_temperature(temperature)
    if input_ids.dim() != 2 or mask.dim() != 2 or mask.shape[0] != input_ids.shape[0]:
        raise ValueError(
            f"mask: shape {tuple(mask.shape)} is not (B, T) for input_ids {tuple(input_ids.shape)}"
        )
    if input_ids.shape[1] < mask.shape[1]:
        raise ValueError("mask: has more columns than input_ids")
    keep = mask.bool()
    lead = _left_padding(attention_mask, input_ids, keep)
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    frozen = {k: v.detach() for k, v in model.named_parameters() if not v.requires_grad}
    frozen.update(dict(model.named_buffers()))
    out = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
    width = mask.shape[1]
    was_training = model.training
    model.eval()  # dropout would make the score random
    try:
        for row in range(input_ids.shape[0]):
            cols = keep[row].nonzero().flatten()
            if cols.numel() == 0:
                continue
            ids = input_ids[row, int(lead[row]) :]
            n = width - int(cols[0])  # score the last n tokens of the row: from its first policy token on
            if n >= ids.shape[0]:
                raise ValueError("mask: the first token of a sequence has no logits that predict it")
            at = cols - cols[0]  # policy tokens among those n
            targets = ids[ids.shape[0] - n :][at]

            def token_logprobs(p: dict, ids=ids, n=n, at=at, targets=targets) -> torch.Tensor:
                logits = predicting(_logits(model, {**p, **frozen}, ids), n)[0, at]
                logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
                return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)

            if method == "vmap":
                grads = jacrev(token_logprobs)(params)
                flat = [g.reshape(cols.numel(), -1) for g in grads.values()]
                sq = sum(f.double().square().sum(dim=1) for f in flat)
            else:
                with torch.enable_grad():
                    live = {k: v.clone().requires_grad_(True) for k, v in params.items()}
                    lp = token_logprobs(live)
                    sq = torch.stack(
                        [
                            sum(
                                g.double().square().sum()
                                for g in torch.autograd.grad(lp[k], list(live.values()), retain_graph=True)
                            )
                            for k in range(cols.numel())
                        ]
                    )
            out[row, cols] = sq.to(out.device)
    finally:
        model.train(was_training)
    return out


@register_estimator(
    "otb_exact",
    options=("model", "input_ids", "attention_mask", "temperature", "method", *ESTIMATORS["otb"].options),
    masked_output=True,
    needs_model=True,
)
def otb_exact(
    batch: Rollouts,
    *,
    model: torch.nn.Module | None = None,
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    method: str = "vmap",
    **otb_options: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OTB with exact per-token score norms ||grad_theta log pi(y_t)||^2 as the energy (the limit the
    Logit-Gradient Proxy approximates). Needs `model` and `input_ids` (and `attention_mask` for padded
    input; see `score_sq_norms`); takes
    otb's options. With `energy=` given instead, that energy is used as is."""
    if batch.energy is None:
        if model is None or input_ids is None:
            raise ValueError("model: otb_exact needs model= and input_ids= (or precomputed energy=)")
        energy = score_sq_norms(
            model, input_ids, batch.mask, temperature, method, attention_mask=attention_mask
        )
        batch = dataclasses.replace(batch, energy=energy.to(batch.mask.device))
    return otb(batch, **otb_options)
